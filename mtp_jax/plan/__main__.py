"""`python -m mtp_jax.plan`: the decode loop compiled for a device topology and projected.

The command itself: mtp_jax/cli/plan.py."""

from mtp_jax.cli.plan import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

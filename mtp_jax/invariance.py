"""`python -m mtp_jax.invariance`: where a row's numbers depend on its batch, layer by layer.

The command itself: mtp_jax/cli/invariance.py."""

from mtp_jax.cli.invariance import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

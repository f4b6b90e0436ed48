"""`python -m mtp_jax.distill`: self-distilled training data (the command: mtp_jax/cli/distill.py)."""

from mtp_jax.cli.distill import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

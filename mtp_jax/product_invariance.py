"""`python -m mtp_jax.product_invariance`: whether this device's products give a row the same bits at any width.

The command itself: mtp_jax/cli/product_invariance.py."""

from mtp_jax.cli.product_invariance import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

"""`python -m mtp_jax.train_head`: train or finetune an MTP head on a frozen trunk.

The command itself: mtp_jax/cli/train_head.py."""

from mtp_jax.cli.train_head import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

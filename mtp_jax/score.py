"""`python -m mtp_jax.score`: teacher-forced MTP acceptance on given text (the command: mtp_jax/cli/score.py)."""

from mtp_jax.cli.score import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

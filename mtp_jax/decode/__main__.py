"""`python -m mtp_jax.decode`: batch generation from prompts to JSONL or text (the command: mtp_jax/cli/decode.py)."""

from mtp_jax.cli.decode import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

"""`python -m mtp_jax.serve`: an OpenAI-compatible HTTP server (the command: mtp_jax/cli/serve.py)."""

from mtp_jax.cli.serve import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

"""`python -m mtp_jax.bench`: plain vs MTP decoding and the peers, side by side (the command: mtp_jax/cli/bench.py)."""

from mtp_jax.cli.bench import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

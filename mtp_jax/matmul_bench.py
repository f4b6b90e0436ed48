"""`python -m mtp_jax.matmul_bench`: one projection's time by weight format and kernel.

The command itself: mtp_jax/cli/matmul_bench.py."""

from mtp_jax.cli.matmul_bench import main
from mtp_jax.runtime.errors import exit_process


def command() -> None:
    """The command's process: its exit status, through `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    command()

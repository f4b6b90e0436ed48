"""The project's error types (one base, `MtpError`) and the entry points' one-line reporting of them."""

import argparse
import sys


class MtpError(Exception):
    """A problem the user can fix; its message is the one line shown to the user."""


class UserError(MtpError):
    """A bad input or environment problem: a flag, a prompt file, an output path, a device budget."""


class ConversionError(MtpError):
    """A checkpoint that cannot be mapped: unknown family, missing/unexpected tensor, bad shape, corrupt file."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusal of a bad flag is one line ("error: ...", exit status 2), no usage dump."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def run_cli(run, args) -> int:
    """Call `run(args)`; a bad input or checkpoint, or a file that cannot be read or written, becomes one line on
    stderr and exit status 1; Ctrl-C one line (what was kept, when `run` says) and status 130."""
    try:
        return run(args)
    except MtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted{f': {e}' if e.args else ''}", file=sys.stderr)
        return 130

"""The project's error types (one base, `MtpError`) and the entry points' one-line reporting of them."""

import argparse
import os
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


def exit_process(code: int) -> None:
    """End a command-line process with `code`. After Ctrl-C (130) the interpreter's own teardown is skipped (the
    output is flushed first, and `run_cli` has already let every `finally` and `with` run): a compile or trace cut
    short left XLA objects whose destructors crashed the exit with a segmentation fault (status 139)."""
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


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

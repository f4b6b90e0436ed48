"""The exception type for problems the user can fix, and the entry points' one-line reporting of them."""


class UserError(Exception):
    """A bad input or environment problem whose message is the one line shown to the user."""


def run_cli(run, args) -> int:
    """Call `run(args)`; a bad input or checkpoint, or a file that cannot be read or written, becomes one line on
    stderr and exit status 1; Ctrl-C one line (what was kept, when `run` says) and status 130."""
    import sys

    from checkpoints_convert.errors import ConversionError

    try:
        return run(args)
    except (UserError, ConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted{f': {e}' if e.args else ''}", file=sys.stderr)
        return 130

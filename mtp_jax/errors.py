"""The exception type for problems the user can fix."""


class UserError(Exception):
    """A bad input or environment problem whose message is the one line shown to the user."""


def run_cli(run, args) -> int:
    """Call `run(args)`; a bad input or checkpoint becomes one line on stderr and exit status 1."""
    import sys

    from checkpoints_convert.errors import ConversionError

    try:
        return run(args)
    except (UserError, ConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

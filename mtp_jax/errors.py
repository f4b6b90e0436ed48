"""The exception type for problems the user can fix."""


class UserError(Exception):
    """A bad input or environment problem whose message is the one line shown to the user."""

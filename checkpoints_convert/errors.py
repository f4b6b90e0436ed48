"""The one exception type conversion raises: its message is the single line a user sees."""


class ConversionError(Exception):
    """A checkpoint that cannot be mapped: unknown family, missing/unexpected tensor, bad shape, corrupt file."""

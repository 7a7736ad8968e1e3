"""The one exception type ktm raises for bad input; the CLI turns it into a one-line message."""


class KTMError(Exception):
    """A user-facing error: the message names the bad value and what was expected."""

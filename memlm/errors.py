"""User-facing errors: the command line prints them as one line and exits non-zero."""


class MemlmError(Exception):
    """An error the user can fix; its message says what to do. Never shown with a traceback."""

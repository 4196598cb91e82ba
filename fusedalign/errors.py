"""Errors that are the user's to fix: the CLI prints them without a traceback."""

# Bad flags, bad data rows, unknown names and missing paths all raise these, with a
# message naming the flag, row or path and what was expected.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, NotImplementedError)

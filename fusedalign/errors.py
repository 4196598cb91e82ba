"""Errors that are the user's to fix: the CLI prints them as one line, without a traceback."""

from __future__ import annotations


class CLIError(ValueError):
    """A user error on the command line (a flag, a path, an output directory)."""


class LaunchError(CLIError):
    """An `accelerate launch` that would not run what its config file asks for."""


# Bad flags, bad data rows, unknown names and missing paths all raise these, with a
# message naming the flag, row or path and what was expected. DataError and
# ModelNotFoundError are ValueError subclasses.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, NotImplementedError)


def flag_value(value: object) -> object:
    """A flag's value as the user typed it: `steps`, not `IntervalStrategy.STEPS` (the enum
    TrainingArguments turns strategy strings into formats with its class name)."""
    import enum

    return value.value if isinstance(value, enum.Enum) else value


def one_line(err: BaseException) -> str:
    """The message of a user error on one line (a multi-line message is joined by ' | ')."""
    text = str(err).strip() or type(err).__name__
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())

"""What ``lmkv`` exits with, and the two failures of its own (bad input, missing feature)."""

from __future__ import annotations

import enum
from collections.abc import Mapping

import typer

from ..errors import (
    AuthenticationError,
    InvalidInputError,
    ServerTimeoutError,
    ServerUnavailableError,
    UnsupportedOperationError,
)

# typer >= 0.16 vendors click (typer._click); take its classes from typer itself.
ClickUsageError: type[Exception] = next(
    k for k in typer.BadParameter.__mro__ if k.__name__ == "UsageError")
ClickException: type[Exception] = next(
    k for k in typer.BadParameter.__mro__ if k.__name__ == "ClickException")


def is_named(exc: BaseException, name: str) -> bool:
    return any(k.__name__ == name for k in type(exc).__mro__)


class ExitCode(enum.IntEnum):
    """What ``lmkv`` exits with."""

    OK = 0
    SERVER_ERROR = 1
    USAGE = 2
    UNREACHABLE = 3
    AUTH = 4
    NOT_AVAILABLE = 5
    INTERRUPTED = 130


#: ``{code: meaning}``, as documented in the module docstring and ``docs/cli.md``.
EXIT_CODES: Mapping[int, str] = {
    ExitCode.OK: "success",
    ExitCode.SERVER_ERROR: "the server failed or answered something unusable",
    ExitCode.USAGE: "usage error or bad input",
    ExitCode.UNREACHABLE: "the server is unreachable or did not answer in time",
    ExitCode.AUTH: "authentication failed (API key missing or wrong)",
    ExitCode.NOT_AVAILABLE: "this build or this server lacks the feature",
    ExitCode.INTERRUPTED: "interrupted",
}


class UsageProblem(Exception):
    """Bad command-line input: exit code 2, one line."""


class NotAvailable(Exception):
    """The feature is missing from this build: exit code 5, one line."""


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code an exception maps to (see :data:`EXIT_CODES`)."""
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, AuthenticationError):
        return ExitCode.AUTH
    if isinstance(exc, (ServerTimeoutError, ServerUnavailableError, TimeoutError,
                        ConnectionError)):
        return ExitCode.UNREACHABLE
    if isinstance(exc, (UnsupportedOperationError, NotAvailable)):
        return ExitCode.NOT_AVAILABLE
    if isinstance(exc, (InvalidInputError, UsageProblem, ClickUsageError)):
        return ExitCode.USAGE
    return ExitCode.SERVER_ERROR


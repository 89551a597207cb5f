"""Errors that reach the user.

A :class:`UserError` is bad input: the CLI prints it as one line and exits with code 2, with no
traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (a recipe, a path, a flag). Printed as ``file:line: key: message``."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None):
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.key = key

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        key = f"{self.key}: " if self.key else ""
        return f"{where}{key}{self.message}"


class BudgetExhausted(Exception):
    """The accountant refused a charge: the run stops cleanly before the release is used."""

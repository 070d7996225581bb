"""The exception types for user mistakes: the CLI prints a message as one line and exits non-zero
(`USAGE_ERROR` for command-line misuse, `RUN_ERROR` for what is found later); over HTTP a
UserError becomes a 400 whose `param` is the error's `field`. And the one-line argument parser of
every entry point (`CliParser`)."""

from __future__ import annotations

import argparse

USAGE_ERROR, RUN_ERROR = 2, 1


class UserError(ValueError):
    """A mistake the user can fix (bad path, bad flag, model that does not fit the mesh...).
    `field`: the request field or argument it concerns (an HTTP error's `param`), when there is
    one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UsageError(Exception):
    """A command-line misuse: printed as one `error: ...` line, exit USAGE_ERROR."""


class CliParser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise UsageError(f"{message} (see --help)")

"""The one exception type for user mistakes: the CLI prints its message as one line and exits
non-zero; over HTTP it becomes a 400 whose `param` is the error's `field`."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake the user can fix (bad path, bad flag, model that does not fit the mesh...).
    `field`: the request field or argument it concerns (an HTTP error's `param`), when there is
    one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

"""The one exception type for user mistakes: the CLI prints its message as one line and exits non-zero."""


class UserError(ValueError):
    """A mistake the user can fix (bad path, bad flag, model that does not fit the mesh...)."""

"""Errors a user can act on. The CLI prints their message as one line and exits non-zero."""


class OscarError(Exception):
    """A failure with a one-line, actionable message (bad path, corrupt bundle, NaN statistics...)."""

"""Errors a user can act on. The CLI prints their message as one line and exits non-zero."""


class OscarError(Exception):
    """A failure with a one-line, actionable message (bad path, corrupt bundle, NaN statistics...); exit 1."""


class UsageError(OscarError):
    """A flag whose value, or combination with others, the command cannot take; exit 2, as for a bad option."""

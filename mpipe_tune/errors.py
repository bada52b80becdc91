"""The project's error class.

A :class:`MpipeError` is a user error: bad input that the user can fix. Its message is one line that
names what is wrong (the field, the value, what must hold) and how to fix it. The CLI prints it and
exits with code 2. Programmer errors are ``assert``s and are not caught.
"""

from __future__ import annotations


class MpipeError(ValueError):
    """A user error: one line naming what is wrong and how to fix it."""


class NotSupportedError(MpipeError):
    """A valid request that this version cannot carry out yet (the message says which part)."""

"""The one exception type devcluster raises for problems a user can fix.

The CLI prints its message alone (no traceback), so every message must say what went wrong and
what to do about it.
"""

from __future__ import annotations


class DevclusterError(Exception):
    """A problem with the user's input or environment, explained in the message."""

"""The ``Retry-After`` header, read the one way the hub client and the team proxy both need."""

from __future__ import annotations

import email.utils
import time


def retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds from now (delta-seconds or an HTTP date); None if absent,
    unreadable or already past."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value) or None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    seconds = when.timestamp() - time.time()
    return seconds if seconds > 0 else None

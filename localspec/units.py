"""How sizes read in messages: one formatter for every command (downloads, status, models)."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """``1234567`` -> ``1.23 MB`` (decimal units, as download sizes are quoted); ``?`` for
    an unknown size."""
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def gib(n: float) -> str:
    """``3 * 2**30`` -> ``3.00``: memory in binary gigabytes, as plans quote it."""
    return f"{n / 2**30:.2f}"

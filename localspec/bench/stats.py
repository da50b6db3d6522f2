"""Small statistics for benchmark reports (pure; no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in 0..100; None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def share(hits: int, total: int) -> float | None:
    return hits / total if total else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either side is missing or ``b`` is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(value: float | None, spec: str = ".0f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)

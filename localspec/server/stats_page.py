"""The /stats page and the JSON it polls (/stats/data): what speculation and the machine are
doing now. The page (stats.html) is one self-contained file: its charts are drawn on canvases
by its own script, nothing is fetched from outside."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import psutil

from localspec.server.speculation import SpecStats

PAGE = Path(__file__).with_name("stats.html")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by the nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def machine(threads: tuple[int, float] | None) -> dict[str, Any]:
    """Cores, load, and the threads the engine may use now (``(free, other_busy)``)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cores": psutil.cpu_count(logical=True) or 1,
        "load": [round(v, 2) for v in load],
        "cpu_percent": psutil.cpu_percent(interval=None),
        "engine_threads": None if threads is None else threads[0],
        "other_busy_cores": None if threads is None else round(threads[1], 2),
    }


def data(spec: SpecStats, threads: tuple[int, float] | None, *, since: float = 0.0) -> dict:
    """What the page draws: acceptance by language and position, the requests that ended
    after ``since`` (wall-clock seconds), latency percentiles over all kept requests, cache
    reuse, and the machine."""
    snap = spec.snapshot(since)
    every = spec.snapshot(0.0)["recent"] if since > 0 else snap["recent"]
    latencies = [p["latency_ms"] for p in every]
    reused = sum(p["reused"] for p in every)
    evaluated = sum(p["evaluated"] for p in every)
    rates = [p["tokens_per_s"] for p in every if p["predicted"]]
    return {
        **snap,
        "latency_ms": {
            "p50": percentile(latencies, 0.5),
            "p95": percentile(latencies, 0.95),
            "n": len(latencies),
        },
        "tokens_per_s": {"p50": percentile(rates, 0.5), "n": len(rates)},
        "cache": {
            "reused": reused,
            "evaluated": evaluated,
            "ratio": round(reused / (reused + evaluated), 4) if reused + evaluated else None,
        },
        "machine": machine(threads),
    }

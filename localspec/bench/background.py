"""Busy background processes for a benchmark: a developer's machine is rarely idle.

``busy_loops(n)`` starts ``n`` CPU-bound processes (a ``while True: pass``, one core each, as a
build or a test run would take) for the duration of a ``with`` block and stops them after,
also when the benchmark fails or is interrupted, or is killed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from localspec.engine.threads import SAMPLE_S

# idle seconds before each server's turn: localspec's thread rule (engine/threads.py) reads
# the last SAMPLE_S of other processes' CPU as load, so a turn that began the instant another
# server's ended would run its first evaluations on fewer threads, for load the benchmark
# made, not the machine (the first prompt after another server's turn ran slower than the rest)
TURN_GAP_S = 2.5 * SAMPLE_S


# ``while True: pass`` that ends with the benchmark: a benchmark killed where no ``finally``
# runs (SIGTERM, a closed terminal, SIGKILL) must not leave a core busy for good. The parent
# is looked at every ~10 ms of spinning.
BUSY_LOOP = """
import os, sys
parent = int(sys.argv[1])  # not getppid() here: the parent may be gone before this runs
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


@contextlib.contextmanager
def busy_loops(n: int, *, settle_s: float = 0.5) -> Iterator[list[int]]:
    """Run ``n`` busy loops while the block runs (their pids are yielded); ``settle_s``
    lets the scheduler spread them before the first measurement."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP, str(os.getpid())], stdin=subprocess.DEVNULL
        )
        for _ in range(max(0, n))
    ]
    try:
        if procs:
            time.sleep(settle_s)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def levels(text: str) -> list[int]:
    """``--background 0,1,2`` → [0, 1, 2] (each a count of busy loops, run in turn)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--background takes counts like 0,1,2, not {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--background takes counts like 0,1,2, not {text!r}")
    return values

"""How many threads a llama.cpp evaluation runs on: the cores other processes leave free now.

ggml synchronises its threads with a barrier after every graph node (about 750 a token for a
30-layer model), and a thread that reaches one spins until the others arrive. When another
process holds one of the cores, a descheduled member of the team stalls the rest at nearly
every barrier for a scheduler slice: on 2 cores beside one busy process, 2 threads decoded
far slower than 1 (bench/results/speculative/history-20-*.json; docs/engine.md, "Threads follow
the load").
So the thread count follows the load: every evaluation runs on at most the cores that other
processes left idle over the last fraction of a second, re-measured as it changes.

Other processes' load is what the whole machine was busy with (``/proc/stat``) less what this
process used itself (its own threads are the ones being placed), averaged over a short window.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# a core counts as taken when other processes kept it this busy over the window: a thread
# sharing a core with a process that runs a third of the time is descheduled often enough
# that the barrier stalls cost more than the thread adds (docs/engine.md, "Threads follow the
# load")
BUSY_CORE = 0.3
SAMPLE_S = 0.2  # the load is re-measured at most this often (two small /proc reads)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: the whole machine busy, this process, and the wall clock."""

    busy_s: float
    own_s: float
    wall_s: float


def sample_cpu() -> CpuSample:
    import psutil

    total = psutil.cpu_times()
    idle = total.idle + getattr(total, "iowait", 0.0)
    busy = sum(total) - idle - getattr(total, "guest", 0.0) - getattr(total, "guest_nice", 0.0)
    own = psutil.Process().cpu_times()
    return CpuSample(busy, own.user + own.system, time.monotonic())


def other_busy_cores(before: CpuSample, after: CpuSample) -> float:
    """Cores other processes kept busy between two samples."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / wall)


def free_cores(cores: int, other_busy: float, busy_core: float = BUSY_CORE) -> int:
    """Cores a team of threads can have to itself: a core is taken once other processes use
    ``busy_core`` of one. Never below 1 (the work has to run somewhere)."""
    taken = int(other_busy + (1.0 - busy_core))  # 0.3 of a core busy takes it, 0.29 does not
    return max(1, cores - taken)


class ThreadGovernor:
    """The thread count for the next evaluation, from the load other processes put on the CPU.

    Shared by an engine's contexts; each applies ``min(its cap, threads())`` before a decode.
    Thread-safe (a pipelined draft decodes on its own thread)."""

    def __init__(
        self,
        cores: int,
        *,
        sample: Callable[[], CpuSample] = sample_cpu,
        interval_s: float = SAMPLE_S,
        busy_core: float = BUSY_CORE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``sample``: the CPU counters; ``clock``: the one their ``wall_s`` is read from."""
        self.cores = max(1, cores)
        self._sample = sample
        self._clock = clock
        self.interval_s = interval_s
        self.busy_core = busy_core
        self._lock = threading.Lock()
        self._last = sample()
        self.other_busy = 0.0  # cores other processes used over the last window
        self.free = self.cores
        self.n_changes = 0  # how often the choice changed (a flapping rule would show here)
        self.n_samples = 0

    def threads(self) -> int:
        """Free cores now (re-measured when the last measurement is older than the interval:
        this runs before every decode, so most calls only read the clock)."""
        if self._clock() - self._last.wall_s < max(self.interval_s, 1e-6):
            return self.free
        with self._lock:
            current = self._sample()
            if current.wall_s - self._last.wall_s < max(self.interval_s, 1e-6):
                return self.free  # another thread has just re-measured
            self.other_busy = other_busy_cores(self._last, current)
            self._last = current
            self.n_samples += 1
            free = free_cores(self.cores, self.other_busy, self.busy_core)
            if free != self.free:
                self.free = free
                self.n_changes += 1
            return self.free

    def keep_fresh(self) -> Callable[[], None]:
        """Re-measure every interval on a thread of its own until the returned function is
        called. A decision then rests on the last fraction of a second: measured only when
        the engine runs, the first decode of a request would average the whole time since the
        last one, and a build (or another model) that ran and ended meanwhile would cost it
        a core for the first 0.2 s (150-180 ms more for a 169-token prompt here)."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(self.interval_s):
                self.threads()

        thread = threading.Thread(target=run, name="localspec-load", daemon=True)
        thread.start()

        def halt() -> None:
            stop.set()
            thread.join(timeout=5.0)

        return halt


def physical_cores() -> int:
    try:
        import psutil

        return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except Exception:  # psutil missing or unable to tell: fall back to logical cores
        return max(1, os.cpu_count() or 1)

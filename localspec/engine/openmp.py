"""The OpenMP runtime llama.cpp's CPU backend runs its threads on (libgomp, on Linux builds).

Every thread that calls llama.cpp keeps an OpenMP team of its own: the completion engine's
worker, a chat model's worker, a pipelined draft's thread. Once the process holds more
OpenMP threads than the machine has CPUs, libgomp spins only briefly at every barrier (its
"throttled" count) and ggml's threads sleep and wake at nearly every graph node, in every
team: on 2 cores, completions decoded at half speed after one chat request had made a second
team. A thread with nothing to do therefore hands its team back (``release_thread_team``), so
only the teams that are working count (docs/engine.md, "One process, several thread teams").
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep nothing else to restore


_found: list[ctypes.CDLL] = []  # the runtime, once found (looked up again until then)


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded with llama.cpp (None: not loaded, or not Linux)."""
    if _found:
        return _found[0]
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/libgomp" in fields[5] and ".so" in fields[5]:
            lib = ctypes.CDLL(fields[5].strip())  # dlopen of a loaded path returns that copy
            if not hasattr(lib, "omp_pause_resource_all"):  # libgomp before GCC 9
                return None
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            _found.append(lib)
            return lib
    return None


# A pause never overlaps an evaluation on another thread: the daemon crashed (SIGSEGV in
# llama_decode) in stress runs of concurrent chat and completions, which taking turns ended
# (server/worker.py), and a pipelined draft's thread still decodes beside its engine's turns.
# Evaluations count themselves in; a pause happens only while none runs, and evaluations wait
# for a pause in progress (microseconds).
_gate = threading.Lock()
_running = 0


@contextmanager
def evaluating() -> Iterator[None]:
    """Around every llama.cpp evaluation (a llama_decode), on any thread."""
    global _running
    with _gate:
        _running += 1
    try:
        yield
    finally:
        with _gate:
            _running -= 1


def release_thread_team() -> bool:
    """Hand back the calling thread's OpenMP threads (libgomp's ``omp_pause_resource_all``)
    unless another thread is evaluating now (then they stay until this thread's next idle
    moment); its next llama.cpp call starts a new team (a thread start per team member).
    Returns whether the team was handed back."""
    lib = _libgomp()
    if lib is None:
        return False
    with _gate:
        return _running == 0 and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0

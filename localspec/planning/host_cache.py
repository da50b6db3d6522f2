"""How much host memory the cache of slot contexts may hold (engine/hostcache.py): pure.

llama-server keeps its prompt cache in up to ``--cache-ram`` 8 GiB by default. Here the same
cap, and never more than half the host memory the plan leaves free after the models and their
KV, so the cache can never push the machine into swap; ``cache.ram_gb`` sets it instead (0:
off).
"""

from __future__ import annotations

from collections.abc import Sequence

from localspec.planning.types import DeviceMemory

GIB = 1 << 30
DEFAULT_CAP = 8 * GIB  # llama-server's --cache-ram default (8192 MiB)
FREE_SHARE = 0.5  # of the host memory left free after the models


def host_cache_budget(free_bytes: int, asked_gb: float | None = None) -> int:
    """Bytes for the host cache: ``asked_gb`` when set, else min(8 GiB, half of
    ``free_bytes``)."""
    if asked_gb is not None:
        return int(asked_gb * GIB)
    return max(0, min(DEFAULT_CAP, int(max(0, free_bytes) * FREE_SHARE)))


def plan_free_bytes(memory: Sequence[DeviceMemory]) -> int:
    """The host memory a plan leaves free: its last memory row's (the host's) budget less its
    use."""
    if not memory:
        return 0
    host = memory[-1]
    return max(0, host.budget - host.used)

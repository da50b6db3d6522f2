"""Which slot serves a request: pure functions over the slots' cached token lists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localspec.engine.cache_plan import common_prefix


@dataclass
class SlotInfo:
    """What the server knows of a slot without touching the engine (read by /slots)."""

    id: int
    n_ctx: int
    tokens: list[int]  # the slot's cached tokens after its last request
    last_used: float = 0.0  # monotonic time of its last request; 0 = never
    is_processing: bool = False
    n_requests: int = 0
    last_prompt_n: int = 0
    last_cache_n: int = 0

    def to_json(self, *, speculative: bool) -> dict[str, object]:
        return {
            "id": self.id,
            "n_ctx": self.n_ctx,
            "speculative": speculative,
            "is_processing": self.is_processing,
            "n_prompt_tokens": len(self.tokens),
            "n_prompt_tokens_processed": self.last_prompt_n,
            "n_prompt_tokens_cache": self.last_cache_n,
            "n_requests": self.n_requests,
        }


def pinned_slot(id_slot: int, n_slots: int) -> int | None:
    """llama-server's rule: a non-negative id wraps around the slot count; -1 means any."""
    return None if id_slot < 0 else id_slot % n_slots


def choose_slot(prompt: Sequence[int], slots: Sequence[SlotInfo], id_slot: int = -1) -> int:
    """The pinned slot, else the idle slot sharing the longest prefix (ties: least recent)."""
    pinned = pinned_slot(id_slot, len(slots))
    if pinned is not None:
        return pinned
    candidates = [s for s in slots if not s.is_processing] or list(slots)
    best = max(candidates, key=lambda s: (common_prefix(prompt, s.tokens), -s.last_used))
    return best.id

"""A cold jump answered within the client's budget (``cache.jump_policy`` = ``budget``).

Both editors send ``t_max_prompt_ms`` (500 by default) with every /infill request. When the
part of the prompt the chosen slot does not hold (after the host cache's restore) would take
longer than that to evaluate at the engine's measured prefill price, the answer comes from a
short FIM prompt of the cursor's nearest lines (the prefix's tail and the suffix's head, with
llama-server's 3:1 split of a smaller window, no extra context), evaluated in a spare
sequence (``Task.apart``), while the full prompt fills the slot behind it (``Task.behind``)
so the next keystroke at that place finds it cached. Before any price is measured the request
waits, as under ``wait``: a guess could answer from too little for nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from localspec.engine.api import ServedEngine
from localspec.engine.types import PromptLayout

# the share of the budget the short prompt's evaluation is sized to: the measured price is an
# average over pieces at other depths and loads, and the answer's first token follows it
SAFETY = 0.8
MIN_WINDOW = 64  # fewer tokens of the file hold too little to answer from, whatever it costs

ShortPrompt = Callable[[ServedEngine, int], PromptLayout]  # (engine, window) -> the prompt


@dataclass(frozen=True)
class PromptBudget:
    """Why and how an answer was made from the nearest lines: the response's
    ``prompt_budget``, the request log's ``budget=1``."""

    t_max_prompt_ms: int
    n_uncached: int  # tokens of the full prompt the slot did not hold
    est_ms: float  # their evaluation at the measured price
    n_ctx_tokens: int  # tokens of the short prompt the answer came from

    def to_json(self) -> dict[str, Any]:
        return {
            "used": True,
            "n_ctx_tokens": self.n_ctx_tokens,
            "n_uncached": self.n_uncached,
            "est_prompt_ms": round(self.est_ms, 1),
            "t_max_prompt_ms": self.t_max_prompt_ms,
        }


def short_prompt(
    engine: ServedEngine,
    layout: PromptLayout,
    slot: int,
    *,
    t_max_prompt_ms: int,
    short: ShortPrompt | None,
) -> tuple[PromptBudget, PromptLayout] | None:
    """The short prompt to answer from, or None when the full one fits the budget (or no
    budget, price or short prompt is known)."""
    if t_max_prompt_ms <= 0 or short is None:
        return None
    n_uncached, price = engine.prompt_cost(slot, layout)
    if price <= 0:
        return None
    est = n_uncached * price
    if est <= t_max_prompt_ms:
        return None
    window = max(MIN_WINDOW, int(t_max_prompt_ms * SAFETY / price))
    nearest = short(engine, window)
    if not nearest.tokens or len(nearest.tokens) >= n_uncached:
        return None  # (no cheaper than what the slot lacks)
    # the answer's sequence shares the KV buffer with the slot's: both must fit the context
    if len(layout.tokens) + len(nearest.tokens) >= engine.n_ctx:
        return None
    return PromptBudget(t_max_prompt_ms, n_uncached, est, len(nearest.tokens)), nearest

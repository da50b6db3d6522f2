"""What the user (or IT) asks of a plan, and its translation from localspec's Settings."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from localspec.engine.types import SpecSettings
from localspec.planning.types import ModelFacts, PlanError, StepCosts


@dataclass(frozen=True)
class PlanSettings:
    """What the user (or IT) asks of the plan; None means 'let the planner choose'."""

    allowed: tuple[str, ...] = ()  # fnmatch patterns of pair ids / model ids; empty: all
    pair: str | None = None  # try this pair first
    context: int | None = None  # tokens per slot; None: 16384 personal, 8192 datacenter
    min_context: int = 4096  # shrink the context no further than this
    n_slots: int | None = None  # None: 1 on a personal machine, sized for sessions otherwise
    gpu_memory_cap_bytes: int | None = None  # per GPU
    concurrent_sessions: int | None = None  # datacenter: developer sessions to hold
    max_token_ms: float = 50.0  # p95 time per generated token; also the slowest plan accepted
    acceptance: float = 0.7  # assumed draft acceptance rate for the speedup estimate
    spec_n_max: int = 16
    requests_per_session_per_min: float = 6.0  # an active developer's completion requests
    tokens_per_request: int = 32  # generated tokens per FIM answer
    new_prompt_tokens_per_request: int = 256  # prompt tokens not already in the slot cache
    threads: int | None = None
    allow_q4_kv: bool = False  # q4_0 KV costs quality; off unless asked
    draft_models: bool = True  # False: n-gram pairs only (speculative.mode off or ngram)
    speculative: SpecSettings = field(default_factory=SpecSettings)  # handed to the engine
    cache_reuse: int = 256  # handed to the engine
    cache_exact_ms: float = 100.0  # handed to the engine (EngineSettings.exact_ms)
    measured: Mapping[tuple[str, str], ModelFacts] = field(default_factory=dict)
    """(model id, quant) -> facts read from a GGUF on disk; replaces the catalog estimate."""
    step_costs: Mapping[tuple[str, str], StepCosts] = field(default_factory=dict)
    """(model id, quant) -> step times measured on this machine; replace the bandwidth model."""
    needs: tuple[str, ...] = ("fim",)  # what the target must do (catalog capabilities)
    # the chat side (planning/chat.py): "auto" decides it, "off" serves none; None: this is
    # the search for the chat pair itself
    chat: Literal["auto", "off"] | None = "auto"
    chat_pair: str | None = None  # try only this pair for chat
    chat_allowed: tuple[str, ...] = ()  # patterns the chat pair must match (models.allowed)


def is_allowed(patterns: Sequence[str], *names: str) -> bool:
    """No patterns allow everything; otherwise any name matching any pattern."""
    return not patterns or any(fnmatch.fnmatch(n, p) for p in patterns for n in names)


def plan_settings_from(settings: Any, **overrides: Any) -> PlanSettings:
    """PlanSettings from localspec's layered Settings (models.*, limits.*, server.slots,
    speculative.*, cache.reuse_chunk, cache.exact_ms). A pinned models.pair is the only pair
    considered.
    ``overrides`` set PlanSettings fields no settings key holds (concurrent_sessions=500)."""
    models, limits, spec = settings.models, settings.limits, settings.speculative
    allowed = tuple(models.allowed)
    chat_pair = models.chat_pair
    if chat_pair and not is_allowed(allowed, chat_pair):
        raise PlanError(f"models.chat_pair {chat_pair!r} is not in models.allowed {list(allowed)}")
    if models.pair:
        if not is_allowed(allowed, models.pair):
            raise PlanError(f"models.pair {models.pair!r} is not in models.allowed {list(allowed)}")
        allowed = (models.pair,)
    cap = limits.gpu_memory_gb
    return PlanSettings(
        allowed=allowed,
        pair=models.pair,
        context=limits.context,
        min_context=min(4096, limits.context) if limits.context else 4096,
        n_slots=settings.server.slots,
        gpu_memory_cap_bytes=int(cap * 1e9) if cap else None,
        threads=limits.threads,
        spec_n_max=spec.n_max,
        draft_models=spec.mode not in ("off", "ngram"),
        speculative=SpecSettings(
            mode=spec.mode, n_max=spec.n_max, n_min=spec.n_min, p_min=spec.p_min
        ),
        cache_reuse=settings.cache.reuse_chunk,
        cache_exact_ms=settings.cache.exact_ms,
        chat=models.chat,
        chat_pair=chat_pair,
        chat_allowed=tuple(models.allowed),
        **overrides,
    )

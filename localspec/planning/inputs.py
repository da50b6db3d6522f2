"""What the user (or IT) asks of a plan: plain values, built from localspec's Settings by
``localspec.settings_to.plan_inputs`` (the planner reads no settings model itself)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from localspec.planning.types import ModelFacts, StepCosts

SpecMode = Literal["off", "draft", "ngram", "hybrid", "auto"]


@dataclass(frozen=True)
class Speculation:
    """The ``speculative`` settings the plan carries to the engine (and to a team server's
    launch command); ``localspec.settings_to`` turns them into the engine's SpecSettings."""

    mode: SpecMode = "auto"
    n_max: int = 16
    n_min: int = 0
    p_min: float = 0.75

    def without_draft_model(self) -> Speculation:
        """What serves when no draft model is loaded: the modes that need one draft n-grams."""
        if self.mode in ("draft", "hybrid"):
            return Speculation("ngram", self.n_max, self.n_min, self.p_min)
        return self


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
    spill: bool = True  # a target that does not fit wholly may spill layers to RAM and win
    allow_q4_kv: bool = False  # q4_0 KV costs quality; off unless asked
    draft_models: bool = True  # False: n-gram pairs only (speculative.mode off or ngram)
    speculative: Speculation = field(default_factory=Speculation)  # handed to the engine
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

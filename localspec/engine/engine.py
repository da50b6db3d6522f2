"""The engine: a target (and optional draft) model, per-sequence caches, the step scheduler.

Requests are :class:`~localspec.engine.scheduler.Task`s: a prompt on a slot and one or more
completions. ``submit`` queues one and ``step`` advances every active sequence by one batch
(engine/scheduler.py); ``generate`` and ``generate_many`` run one request to its end. Each
step may verify a draft (from the n-gram drafter or the draft model) for every sequence in
ONE target batch; drafted tokens are accepted while the sequence's own sampler draws them,
the first disagreement emits the target's token, and rejected KV is removed from both models
(engine/completion.py), so the output is the target's own output.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from localspec.engine import hostcache, memory, slotstate
from localspec.engine.alloc import Allocations
from localspec.engine.completion import Completion, draft_window_start
from localspec.engine.errors import EngineError
from localspec.engine.llama import _available_memory
from localspec.engine.pair import ModelPair
from localspec.engine.scheduler import Scheduler
from localspec.engine.slot import Slot, Task
from localspec.engine.threads import ThreadGovernor
from localspec.engine.types import (
    Cancel,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    IndexedTokenCallback,
    PromptLayout,
    SpecSettings,
    TokenCallback,
)
from localspec.planning.host_cache import host_cache_budget

__all__ = ["Engine", "draft_window_start"]


class Engine:
    """A loaded model pair and its scheduler: what a server holds (``ServedEngine``,
    engine/api.py). Not thread-safe: one thread owns it (submit, step, generate)."""

    def __init__(self, settings: EngineSettings) -> None:
        self.pair = ModelPair(settings)
        pair = self.pair
        self.n_slots = pair.n_slots
        self.vocab = pair.vocab
        self.n_ctx = pair.n_ctx
        self.n_batch = pair.n_batch
        self.flash_attn = pair.flash_attn
        self.n_ctx_train = pair.target.n_ctx_train
        self.model_path = pair.target.path
        self.draft_path = pair.draft.path if pair.draft is not None else None
        self.scheduler = Scheduler(pair)
        # contexts a new prompt overwrites, kept in host memory (engine/hostcache.py)
        budget = settings.host_cache_bytes
        if budget is None:
            budget = host_cache_budget(_available_memory())
        self.host_cache = hostcache.HostCache(budget) if budget > 0 else None
        self.slots: Sequence[Slot] = tuple(self.scheduler.slots)

    @classmethod
    def load(cls, settings: EngineSettings) -> Engine:
        return cls(settings)

    def allocated(self) -> tuple[Allocations, Allocations]:
        """llama.cpp's own account of the buffers it allocated: (target, draft)."""
        return self.pair.allocated()

    def memory_report(self) -> dict[str, Any]:
        """The build's backends and the plan's memory beside llama.cpp's, per device."""
        return memory.props(self.pair)

    @property
    def settings(self) -> EngineSettings:
        return self.pair.settings

    @settings.setter
    def settings(self, settings: EngineSettings) -> None:
        """New settings apply from the next request on (benchmarks switch modes)."""
        self.pair.settings = settings

    @property
    def governor(self) -> ThreadGovernor | None:
        """Follows the cores other processes leave free (None: ``follow_load`` is off)."""
        return self.pair.governor

    @governor.setter
    def governor(self, governor: ThreadGovernor | None) -> None:
        self.pair.governor = governor

    @property
    def max_completions(self) -> int:
        """The most completions one request may ask for (they decode at the same time)."""
        return len(self.pair.tcache.aux) + 1

    @property
    def kv_holes(self) -> tuple[int, int]:
        """(cells freed below kept ones, compactions done) in the target's KV buffer: what
        moved runs leave behind, for /metrics."""
        return self.pair.tcache.holes, self.pair.tcache.n_compacted

    # --- public helpers ------------------------------------------------------------------
    def slot_tokens(self, slot: int) -> list[int]:
        """The tokens the slot's target sequence holds now."""
        self.pair.check_slot(slot)
        return self.slots[slot].cached()

    def draft_slot_tokens(self, slot: int) -> list[int]:
        self.pair.check_slot(slot)
        self.pair.settle_draft()
        draft = self.slots[slot].draft
        return list(draft.tokens) if draft is not None else []

    def prefill_draft(self, slot: int, prompt: list[int]) -> None:
        """Evaluate the draft model's window of ``prompt`` now rather than lazily (benchmarks
        keep prompt work out of generation timings)."""
        pair = self.pair
        pair.check_slot(slot)
        if pair.dcache is None:
            return
        pair.settle_draft()
        req = GenerationRequest(slot=slot, prompt=list(prompt), n_predict=0)
        c = Completion(pair, req, self.slots[slot].target, dslot=self.slots[slot].draft)
        try:
            c.sync_draft()
        finally:
            c.close()

    def clear_slot(self, slot: int) -> None:
        """Forget what the slot holds (a failed request may have left it half-written)."""
        self.pair.clear_slot(slot)
        self.slots[slot].hold([])

    def save_slot(self, slot: int) -> slotstate.SlotSnapshot:
        """The slot's context in both models (no request may run on it: engine/slotstate.py)."""
        return slotstate.take(self.pair, slot)

    def restore_slot(self, slot: int, snap: slotstate.SlotSnapshot) -> None:
        """Make the slot hold ``snap``; on a StateError it holds nothing."""
        try:
            slotstate.put(self.pair, slot, snap)
        finally:
            self.slots[slot].hold(self.slots[slot].cached())

    def recall(
        self, slot: int, layout: PromptLayout, *, restore: bool = True
    ) -> hostcache.Recall | None:
        """Before ``layout`` starts on the idle ``slot``: keep the context it would overwrite
        in the host cache, and (``restore``) put back a cached one that serves it better.
        None: no host cache."""
        if self.host_cache is None:
            return None
        self.pair.check_slot(slot)
        return hostcache.recall(
            self.pair, self.host_cache, self.slots[slot], layout, restore=restore
        )

    def prompt_cost(self, slot: int, layout: PromptLayout) -> tuple[int, float]:
        """(about how many of ``layout``'s tokens the idle ``slot`` would evaluate, the
        measured prefill price in ms per token, -1 before any prompt piece was timed): what
        a budget answer (``jump_policy``) decides by."""
        pair = self.pair
        pair.check_slot(slot)
        policy = pair.prefill_policy(True)
        st = self.slots[slot].target
        n = pair.tcache.to_evaluate(st, layout.tokens, policy, layout.blocks)
        return n, pair.tcache.ms_per_token

    @property
    def spare_sequences(self) -> int:
        """Sequences free now for extra completions or an answer apart from its slot."""
        return self.scheduler.spare

    @cached_property
    def identity(self) -> dict[str, Any]:
        """What a saved context is tied to: the model files and the KV's cell types."""
        return slotstate.pair_identity(self.pair)

    def close(self) -> None:
        self.pair.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pipeline_enabled(self, spec: SpecSettings | None = None) -> bool:
        """Whether the draft model runs on its own thread (see ModelPair.pipeline_enabled)."""
        return self.pair.pipeline_enabled(spec)

    def inside_ms(self) -> float:
        """llama.cpp time of the engine's thread (a pipelined draft's runs on its own)."""
        return self.pair.inside_ms()

    # --- requests ----------------------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Queue a request; bad ones raise ValueError here. ``step`` runs it."""
        if self.pair.closed:
            raise EngineError("engine is closed")
        self.scheduler.submit(task)

    def step(self) -> bool:
        """One step of every active request; returns whether work is left."""
        return self.scheduler.step()

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def abort(self, exc: BaseException) -> None:
        """Fail every request in the engine with ``exc`` (their slots start over)."""
        self.scheduler.abort(exc)

    def busy_besides(self, slot: int) -> bool:
        """Another request runs or waits (see Scheduler.busy_besides)."""
        return self.scheduler.busy_besides(slot)

    def generate(
        self,
        req: GenerationRequest,
        *,
        cancel: Cancel | None = None,
        on_token: TokenCallback | None = None,
        prefill_cancel: Cancel | None = None,
    ) -> GenerationResult:
        """Evaluate ``req.prompt`` and generate, to the end. ``prefill_cancel`` (default
        ``cancel``) stops the prompt's evaluation: a server passes a laxer rule, since a
        keystroke's prompt heads the next keystroke's too and evaluating it on after its
        client left is work the next request would otherwise do. Nothing is generated once
        ``cancel`` is set."""
        sink: IndexedTokenCallback | None = None
        if on_token is not None:
            sink = lambda _index, event: on_token(event)  # noqa: E731
        return self.generate_many(
            [req], cancel=cancel, on_token=sink, prefill_cancel=prefill_cancel
        )[0]

    def generate_many(
        self,
        reqs: list[GenerationRequest],
        *,
        cancel: Cancel | None = None,
        on_token: IndexedTokenCallback | None = None,
        prefill_cancel: Cancel | None = None,
    ) -> list[GenerationResult]:
        """Several completions of one prompt (``reqs`` share the first one's slot and prompt,
        each with its own sampling): the prompt is evaluated once and they decode together."""
        task = Task(reqs, cancel=cancel, prefill_cancel=prefill_cancel, on_token=on_token)
        self.submit(task)
        while not task.done:
            self.step()
        if task.error is not None:
            raise task.error
        return task.results

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

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from localspec.engine import memory
from localspec.engine.alloc import Allocations, combine
from localspec.engine.cache import PrefillPolicy, SlotCaches
from localspec.engine.completion import Completion, draft_window_start
from localspec.engine.errors import EngineError
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.pipeline import DraftPipeline
from localspec.engine.policy import SpecPolicy, VerifyCost
from localspec.engine.scheduler import Scheduler, Task
from localspec.engine.threads import ThreadGovernor, physical_cores
from localspec.engine.types import (
    Cancel,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    IndexedTokenCallback,
    SpecSettings,
    TokenCallback,
)
from localspec.engine.vocab import Vocab, check_pair
from localspec.planning.types import MAX_SLOTS, aux_sequences, context_cells

__all__ = ["Engine", "draft_window_start"]


class Engine:
    """A loaded model pair. Not thread-safe: one thread owns it (submit, step, generate)."""

    def __init__(self, settings: EngineSettings) -> None:
        if not 1 <= settings.n_slots <= MAX_SLOTS:
            raise ValueError(f"n_slots must be within 1..{MAX_SLOTS}, got {settings.n_slots}")
        self.settings = settings
        self.n_slots = settings.n_slots
        self.n_aux = aux_sequences(self.n_slots, settings.n_aux)
        self.aux_room = settings.aux_room
        self._clock = Clock()  # the target's llama.cpp time
        self._dclock = Clock()  # the draft's: apart, since it may run on its own thread
        self._closed = False
        # every decode runs on at most the cores other processes leave free (engine/threads.py)
        self.governor = ThreadGovernor(physical_cores()) if settings.follow_load else None
        self._stop_governor: Callable[[], None] | None = None
        self._target = Model(settings.target)
        self._draft: Model | None = None
        self._tctx: Context | None = None
        self._dctx: Context | None = None
        try:
            self.vocab = Vocab(self._target.vocab_handle)
            if settings.draft is not None:
                self._draft = Model(settings.draft)
                check_pair(self.vocab, Vocab(self._draft.vocab_handle))
            self._tctx = Context(
                self._target,
                settings.target,
                # each slot, its scratch and its ring-block sequences, the extra completions'
                n_seq=3 * self.n_slots + self.n_aux,
                n_ctx_total=context_cells(
                    settings.target.n_ctx, self.n_slots, self.n_aux, self.aux_room
                ),
                clock=self._clock,
                governor=self.governor,
                n_slots=self.n_slots,
            )
            if self._draft is not None and settings.draft is not None:
                self._dctx = Context(
                    self._draft,
                    settings.draft,
                    # each slot and its scratch sequence, the extra completions' drafts
                    n_seq=2 * self.n_slots + self.n_aux,
                    n_ctx_total=context_cells(
                        settings.draft.n_ctx, self.n_slots, self.n_aux, self.aux_room
                    ),
                    clock=self._dclock,
                    governor=self.governor,
                    n_slots=self.n_slots,
                )
            if settings.gpu_memory_cap is not None:
                memory.enforce_cap(self, settings.gpu_memory_cap)
        except BaseException:
            self.close()
            raise
        self.n_ctx = settings.target.n_ctx
        self.n_batch = self._tctx.n_batch
        self.flash_attn = self._tctx.flash_attn  # as resolved for where the target runs
        # llama.cpp's CPU flash attention takes a batch of 64 rows or more in tiles of 64
        # query rows (scheduler.FA_TILE_ROWS) and skips a tile of KV cells only where the mask
        # hides it from every row of the tile: a decoding sequence's row in a prompt piece's
        # tile makes the piece's rows attend (in arithmetic) to that sequence's cells as well,
        # which costs more than one more pass over the weights (bench/results/throughput/
        # history-43-*.json). There the pieces go in a batch after the decoding rows'.
        self.pieces_apart = self.flash_attn and settings.target.n_gpu_layers == 0
        self.n_ctx_train = self._target.n_ctx_train
        self.model_path = self._target.path
        self.draft_path = self._draft.path if self._draft is not None else None
        self.draft_n_ctx = settings.draft.n_ctx if settings.draft is not None else 0
        # a draft decode's cost relative to the target's before either is measured: both read
        # their weights once per decode
        self.draft_size_ratio = (
            Path(settings.draft.path).stat().st_size / Path(settings.target.path).stat().st_size
            if settings.draft is not None
            else 0.0
        )
        self._tcache = SlotCaches(self._tctx, self.n_slots, n_aux=self.n_aux, iso=True)
        self._dcache = (
            SlotCaches(self._dctx, self.n_slots, n_aux=self.n_aux, iso=False)
            if self._dctx is not None
            else None
        )
        # speeds and acceptance carry over from request to request (same machine, same code
        # base); the recent-window estimates adapt when either changes. One acceptance model
        # per way of running (see policy_for), one table of step costs per thread count
        self._policies: dict[tuple[object, ...], SpecPolicy] = {}
        self._step_costs: dict[tuple[int, bool], VerifyCost] = {}
        # the last pipelined request's draft thread, until someone needs the draft cache
        self._draft_job: DraftPipeline | None = None
        self.scheduler = Scheduler(self)
        if self.governor is not None:
            self._stop_governor = self.governor.keep_fresh()

    @classmethod
    def load(cls, settings: EngineSettings) -> Engine:
        return cls(settings)

    def allocated(self) -> tuple[Allocations, Allocations]:
        """llama.cpp's own account of the buffers it allocated: (target, draft), each its
        weights, KV, compute and output buffers by buffer type (engine/alloc.py)."""
        parts = [(self._target, self._tctx), (self._draft, self._dctx)]
        target, draft = (combine(x.allocated for x in part if x is not None) for part in parts)
        return target, draft

    @property
    def max_completions(self) -> int:
        """The most completions one request may ask for (they decode at the same time)."""
        return len(self._tcache.aux) + 1

    @property
    def kv_holes(self) -> tuple[int, int]:
        """(cells freed below kept ones, compactions done) in the target's KV buffer: what
        moved runs leave behind, for /metrics."""
        return self._tcache.holes, self._tcache.n_compacted

    # --- public helpers ------------------------------------------------------------------
    def slot_tokens(self, slot: int) -> list[int]:
        self._check_slot(slot)
        return list(self._tcache.slots[slot].tokens)

    def draft_slot_tokens(self, slot: int) -> list[int]:
        self._check_slot(slot)
        self._settle_draft()
        return list(self._dcache.slots[slot].tokens) if self._dcache is not None else []

    def prefill_draft(self, slot: int, prompt: list[int]) -> None:
        """Evaluate the draft model's window of ``prompt`` now rather than lazily (benchmarks
        keep prompt work out of generation timings)."""
        self._check_slot(slot)
        if self._dcache is None:
            return
        self._settle_draft()
        req = GenerationRequest(slot=slot, prompt=list(prompt), n_predict=0)
        c = Completion(self, req, self._tcache.slots[slot])
        try:
            c._sync_draft()
        finally:
            c.close()

    def clear_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self._settle_draft()
        self._tcache.clear(self._tcache.slots[slot])
        if self._dcache is not None:
            self._dcache.clear(self._dcache.slots[slot])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stop_governor is not None:
            self._stop_governor()
        if getattr(self, "_draft_job", None) is not None:
            self._settle_draft()
        for obj in (self._dctx, self._tctx, self._draft, self._target):
            if obj is not None:
                obj.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pipeline_enabled(self, spec: SpecSettings | None = None) -> bool:
        """Whether the draft model runs on its own thread: as set, or (None) when the
        threads of both contexts fit the cores free now, so the draft has a core of its own."""
        spec = spec or self.settings.spec
        if self._dctx is None:
            return False
        if spec.pipeline is not None:
            return spec.pipeline
        t, d = self._tctx, self._dctx
        need = max(t.n_threads, t.n_threads_batch) + max(d.n_threads, d.n_threads_batch)
        return need <= (self.governor.threads() if self.governor else physical_cores())

    def policy_for(self, pipelined: bool, spec: SpecSettings, p_min: float) -> SpecPolicy:
        """The acceptance model of this way of running: a pipelined draft changes what a draft
        costs, and the mode and p_min change what a draft's outcome means (a fixed p_min of
        0.75 turns many would-be-accepted drafts into misses). Its step costs are those of
        the threads the target runs on now."""
        key = (pipelined, spec.mode, spec.adaptive, p_min)
        pol = self._policies.get(key)
        if pol is None:
            pol = SpecPolicy(hidden=("draft",) if pipelined else ())
            self._policies[key] = pol
        pol.verify = self.step_costs(pipelined)
        return pol

    def step_costs(self, pipelined: bool) -> VerifyCost:
        """Measured step time by tokens in the batch, for the target's threads now."""
        assert self._tctx is not None
        key = (self._tctx.threads_now[1], pipelined)
        table = self._step_costs.get(key)
        if table is None:
            table = self._step_costs[key] = VerifyCost()
        return table

    def observe_step(self, n_tokens: int, ms: float, *, pipelined: bool) -> None:
        self.step_costs(pipelined).observe(n_tokens, ms)

    def prefill_policy(self, cache_prompt: bool) -> PrefillPolicy:
        """How the target's cache is reused for a prompt."""
        s = self.settings
        return PrefillPolicy(
            min_chunk=s.cache_reuse if cache_prompt else 0,
            tail_min=s.tail_reuse,
            max_drift=s.tail_max_drift,
            tail_refresh=s.tail_refresh,
            tail_roll=s.tail_roll,
            chunk=s.prefill_chunk,
            exact_ms=s.exact_ms,
            piece_ms=s.prefill_piece_ms,
        )

    def draft_prefill_policy(self, cache_prompt: bool) -> PrefillPolicy:
        """The same for the draft model's window (no exactness budget: it only drafts)."""
        return replace(self.prefill_policy(cache_prompt), exact_ms=0.0)

    def inside_ms(self) -> float:
        """llama.cpp time of the engine's thread (a pipelined draft's runs on its own)."""
        return self._clock.inside_ms + self._dclock.inside_ms

    def _settle_draft(self) -> None:
        """Join the last pipelined request's draft thread; its cache then holds verified
        tokens only."""
        job, self._draft_job = self._draft_job, None
        if job is not None:
            job.finish()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range (0..{self.n_slots - 1})")

    # --- requests ----------------------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Queue a request; bad ones raise ValueError here. ``step`` runs it."""
        if self._closed:
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

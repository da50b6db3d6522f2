"""The loaded target and optional draft model, as the scheduler and the completions use them.

:class:`ModelPair` is what outlives a request: both contexts, their per-sequence caches,
the measured step costs and acceptance models, and the draft thread of the last pipelined
request. The Engine (engine/engine.py) loads one and hands it to its Scheduler, which hands it
to every Completion: they reach the models through its public names, not the Engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from localspec.engine import memory
from localspec.engine.alloc import Allocations, combine
from localspec.engine.cache import PrefillPolicy, SlotCaches
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.pipeline import DraftPipeline
from localspec.engine.policy import SpecPolicy, VerifyCost
from localspec.engine.threads import ThreadGovernor, physical_cores
from localspec.engine.types import EngineSettings, SpecSettings
from localspec.engine.vocab import Vocab, check_pair
from localspec.planning.types import MAX_SLOTS, aux_sequences, context_cells


class ModelPair:
    """A loaded model pair. Not thread-safe: the engine's thread owns it."""

    def __init__(self, settings: EngineSettings) -> None:
        if not 1 <= settings.n_slots <= MAX_SLOTS:
            raise ValueError(f"n_slots must be within 1..{MAX_SLOTS}, got {settings.n_slots}")
        # read on every request (not copied), so a changed ``settings`` applies to the next
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
        self.target = Model(settings.target)
        self.draft: Model | None = None
        self.tctx: Context | None = None
        self.dctx: Context | None = None
        # the last pipelined request's draft thread, until someone needs the draft cache
        self.draft_job: DraftPipeline | None = None
        try:
            self.vocab = Vocab(self.target.vocab_handle)
            if settings.draft is not None:
                self.draft = Model(settings.draft)
                check_pair(self.vocab, Vocab(self.draft.vocab_handle))
            self.tctx = Context(
                self.target,
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
            if self.draft is not None and settings.draft is not None:
                self.dctx = Context(
                    self.draft,
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
        self.n_batch = self.tctx.n_batch
        self.flash_attn = self.tctx.flash_attn  # as resolved for where the target runs
        # llama.cpp's CPU flash attention takes a batch of 64 rows or more in tiles of 64
        # query rows (scheduler.FA_TILE_ROWS) and skips a tile of KV cells only where the mask
        # hides it from every row of the tile: a decoding sequence's row in a prompt piece's
        # tile makes the piece's rows attend (in arithmetic) to that sequence's cells as well,
        # which costs more than one more pass over the weights (bench/results/throughput/
        # history-43-*.json). There the pieces go in a batch after the decoding rows'.
        self.pieces_apart = self.flash_attn and settings.target.n_gpu_layers == 0
        self.draft_n_ctx = settings.draft.n_ctx if settings.draft is not None else 0
        # a draft decode's cost relative to the target's before either is measured: both read
        # their weights once per decode
        self.draft_size_ratio = (
            Path(settings.draft.path).stat().st_size / Path(settings.target.path).stat().st_size
            if settings.draft is not None
            else 0.0
        )
        self.tcache = SlotCaches(self.tctx, self.n_slots, n_aux=self.n_aux, iso=True)
        self.dcache = (
            SlotCaches(self.dctx, self.n_slots, n_aux=self.n_aux, iso=False)
            if self.dctx is not None
            else None
        )
        # speeds and acceptance carry over from request to request (same machine, same code
        # base); the recent-window estimates adapt when either changes. One acceptance model
        # per way of running (see policy_for), one table of step costs per thread count
        self._policies: dict[tuple[object, ...], SpecPolicy] = {}
        self._step_costs: dict[tuple[int, bool], VerifyCost] = {}
        if self.governor is not None:
            self._stop_governor = self.governor.keep_fresh()

    def allocated(self) -> tuple[Allocations, Allocations]:
        """llama.cpp's own account of the buffers it allocated: (target, draft), each its
        weights, KV, compute and output buffers by buffer type (engine/alloc.py)."""
        parts = [(self.target, self.tctx), (self.draft, self.dctx)]
        target, draft = (combine(x.allocated for x in part if x is not None) for part in parts)
        return target, draft

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stop_governor is not None:
            self._stop_governor()
        self.settle_draft()
        for obj in (self.dctx, self.tctx, self.draft, self.target):
            if obj is not None:
                obj.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range (0..{self.n_slots - 1})")

    def settle_draft(self) -> None:
        """Join the last pipelined request's draft thread; its cache then holds verified
        tokens only."""
        job, self.draft_job = self.draft_job, None
        if job is not None:
            job.finish()

    def clear_slot(self, slot: int) -> None:
        """Forget what the slot's sequences hold, in both models."""
        self.check_slot(slot)
        self.settle_draft()
        self.tcache.clear(self.tcache.slots[slot])
        if self.dcache is not None:
            self.dcache.clear(self.dcache.slots[slot])

    def pipeline_enabled(self, spec: SpecSettings | None = None) -> bool:
        """Whether the draft model runs on its own thread: as set, or (None) when the
        threads of both contexts fit the cores free now, so the draft has a core of its own."""
        spec = spec or self.settings.spec
        if self.dctx is None or self.tctx is None:
            return False
        if spec.pipeline is not None:
            return spec.pipeline
        t, d = self.tctx, self.dctx
        need = max(t.n_threads, t.n_threads_batch) + max(d.n_threads, d.n_threads_batch)
        return need <= (self.governor.threads() if self.governor else physical_cores())

    def policy_for(
        self,
        pipelined: bool,
        spec: SpecSettings,
        p_min: float,
        language: str | None = None,
        *,
        oracle: bool = False,
    ) -> SpecPolicy:
        """The acceptance model of this way of running: a pipelined draft changes what a draft
        costs, and the mode and p_min change what a draft's outcome means (a fixed p_min of
        0.75 turns many would-be-accepted drafts into misses). Its step costs are those of
        the threads the target runs on now. With ``spec.by_language`` each language has its
        own (acceptance differs by tens of points between languages: Python's boilerplate
        pays long drafts where shell's does not). Relaxed acceptance and a benchmark's oracle
        (engine/oracle.py) keep records of their own: their runs are not an exact policy's."""
        lang = language if spec.by_language else None
        key = (pipelined, spec.mode, spec.adaptive, p_min, lang, spec.accept, oracle,
               spec.ngram_agree, spec.draft_cost_max, spec.weigh_sources,
               spec.learn_p_min)  # fmt: skip
        pol = self._policies.get(key)
        if pol is None:
            pol = SpecPolicy(hidden=("draft",) if pipelined else ())
            self._policies[key] = pol
        pol.verify = self.step_costs(pipelined)
        return pol

    def step_costs(self, pipelined: bool) -> VerifyCost:
        """Measured step time by tokens in the batch, for the target's threads now."""
        assert self.tctx is not None
        key = (self.tctx.threads_now[1], pipelined)
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

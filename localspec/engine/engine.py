"""The engine: a target (and optional draft) model, per-slot caches, the speculative loop.

``generate`` runs one request on one slot: reuse the slot's cache for the prompt, then emit
tokens. Each step may verify a draft (from the n-gram drafter or the draft model) in ONE
target batch; drafted tokens are accepted while the target's own sampler draws them, the
first disagreement emits the target's token, and rejected KV is removed from both models.
The sampler draws once per emitted token in the same order with or without speculation, so
the output is the target's own output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from localspec.engine.cache import SlotCaches
from localspec.engine.errors import DecodeError, EngineError, PromptTooLongError
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.ngram import NgramIndex
from localspec.engine.pipeline import DraftPipeline
from localspec.engine.policy import SpecPolicy, ngram_source
from localspec.engine.sampling import Sampler
from localspec.engine.stops import StopRules
from localspec.engine.threads import ThreadGovernor, physical_cores
from localspec.engine.types import (
    Cancel,
    DraftStats,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    SpecSettings,
    TokenCallback,
    TokenEvent,
    TokenProbs,
)
from localspec.engine.vocab import Vocab, check_pair

ADAPTIVE_P_MIN = 0.3
CHEAP_DRAFT_PREFILL = 64  # draft prompt tokens a probe of the draft model may cost
CHEAP_DRAFT_CATCHUP = 8  # emitted tokens the draft may be behind for a probe
UNBOUNDED_HORIZON = 256  # tokens a completion without n_predict is expected to run
LINE_TOKENS = 32  # tokens to the newline that ends a completion past t_max_predict_ms
# a pipelined draft keeps drafting past a token it is at least this sure of: free when the
# target then emits that token, about half a draft token late to catch up when it does not
# (measured on the SmolLM2 pair: 0.1 beat 0.3 by 10-30% and 0.0)
PIPELINE_P_CHAIN = 0.1


def draft_window_start(n_prompt: int, window: int) -> int:
    """Where the draft model's view of a prompt begins.

    The start moves in steps of window/4, so while the prompt grows by a few tokens per
    keystroke the draft's cached window keeps its first token and plain prefix reuse works.
    """
    if window <= 0 or n_prompt <= window:
        return 0
    grain = max(1, window // 4)
    return -(-(n_prompt - window) // grain) * grain


class Engine:
    """A loaded model pair. ``generate`` is synchronous and not thread-safe."""

    def __init__(self, settings: EngineSettings) -> None:
        if settings.n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {settings.n_slots}")
        self.settings = settings
        self.n_slots = settings.n_slots
        self._clock = Clock()  # the target's llama.cpp time
        self._dclock = Clock()  # the draft's: apart, since it may run on its own thread
        self._closed = False
        # every decode runs on at most the cores other processes leave free (engine/threads.py)
        self.governor = ThreadGovernor(physical_cores()) if settings.follow_load else None
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
                n_seq=self.n_slots + 2,  # + the scratch sequence, + one for ring blocks
                n_ctx_total=settings.target.n_ctx * self.n_slots,
                clock=self._clock,
                governor=self.governor,
            )
            if self._draft is not None and settings.draft is not None:
                self._dctx = Context(
                    self._draft,
                    settings.draft,
                    n_seq=self.n_slots + 1,
                    n_ctx_total=settings.draft.n_ctx * self.n_slots,
                    clock=self._dclock,
                    governor=self.governor,
                )
        except BaseException:
            self.close()
            raise
        self.n_ctx = settings.target.n_ctx
        self.n_batch = self._tctx.n_batch
        self.flash_attn = self._tctx.flash_attn  # as resolved for where the target runs
        self.n_ctx_train = self._target.n_ctx_train
        self.model_path = self._target.path
        self.draft_path = self._draft.path if self._draft is not None else None
        self.draft_n_ctx = settings.draft.n_ctx if settings.draft is not None else 0
        self._tcache = SlotCaches(self._tctx, self.n_slots)
        self._dcache = SlotCaches(self._dctx, self.n_slots) if self._dctx is not None else None
        # speeds and acceptance carry over from request to request (same machine, same code
        # base); the recent-window estimates adapt when either changes. One cost model per
        # way of running (see _policy_for)
        self._policies: dict[tuple[object, ...], SpecPolicy] = {}
        # the last pipelined request's draft thread, until someone needs the draft cache
        self._draft_job: DraftPipeline | None = None

    @classmethod
    def load(cls, settings: EngineSettings) -> Engine:
        return cls(settings)

    # --- public helpers ------------------------------------------------------------------
    def slot_tokens(self, slot: int) -> list[int]:
        self._check_slot(slot)
        return list(self._tcache.tokens[slot])

    def draft_slot_tokens(self, slot: int) -> list[int]:
        self._check_slot(slot)
        self._settle_draft()
        return list(self._dcache.tokens[slot]) if self._dcache is not None else []

    def prefill_draft(self, slot: int, prompt: list[int]) -> None:
        """Evaluate the draft model's window of ``prompt`` now rather than lazily (benchmarks
        keep prompt work out of generation timings)."""
        self._check_slot(slot)
        if self._dcache is None:
            return
        self._settle_draft()
        run = _Run(self, GenerationRequest(slot=slot, prompt=list(prompt), n_predict=0), None, None)
        try:
            run._sync_draft()
        finally:
            run.close()

    def clear_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self._settle_draft()
        self._tcache.clear(slot)
        if self._dcache is not None:
            self._dcache.clear(slot)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
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

    def _policy_for(self, pipelined: bool, spec: SpecSettings, p_min: float) -> SpecPolicy:
        """The cost model of this way of running: thread counts and a pipelined draft change
        every timing, and the mode and p_min change what a draft's outcome means (a fixed
        p_min of 0.75 turns many would-be-accepted drafts into misses)."""
        t = self._tctx
        key = (pipelined, t.n_threads, t.n_threads_batch, spec.mode, spec.adaptive, p_min)
        pol = self._policies.get(key)
        if pol is None:
            pol = SpecPolicy(hidden=("draft",) if pipelined else ())
            self._policies[key] = pol
        return pol

    def _settle_draft(self) -> None:
        """Join the last pipelined request's draft thread; its cache then holds verified
        tokens only."""
        job, self._draft_job = self._draft_job, None
        if job is not None:
            job.finish()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range (0..{self.n_slots - 1})")

    # --- generation ----------------------------------------------------------------------
    def generate(
        self,
        req: GenerationRequest,
        *,
        cancel: Cancel | None = None,
        on_token: TokenCallback | None = None,
        prefill_cancel: Cancel | None = None,
    ) -> GenerationResult:
        """Evaluate ``req.prompt`` and generate. ``prefill_cancel`` (default ``cancel``) stops
        the prompt's evaluation: a server passes a laxer rule, since a keystroke's prompt heads
        the next keystroke's too and evaluating it on after its client left is work the next
        request would otherwise do. Nothing is generated once ``cancel`` is set."""
        if self._closed:
            raise EngineError("engine is closed")
        self._check_slot(req.slot)
        n_prompt = len(req.prompt)
        if n_prompt == 0:
            raise ValueError("empty prompt")
        if n_prompt >= self.n_ctx:
            raise PromptTooLongError(
                f"prompt of {n_prompt} tokens does not fit the slot context of {self.n_ctx}"
            )
        bad = [t for t in req.prompt if not 0 <= t < self.vocab.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range (n_vocab {self.vocab.n_vocab})")
        run = _Run(self, req, cancel, on_token, prefill_cancel)
        try:
            return run.execute()
        except DecodeError:
            # llama.cpp may keep part of a failed batch: start the slot over next time
            self.clear_slot(req.slot)
            raise
        finally:
            run.close()


class _Run:
    """One generate() call: its state lives here so the engine object stays small."""

    def __init__(
        self,
        engine: Engine,
        req: GenerationRequest,
        cancel: Cancel | None,
        on_token: TokenCallback | None,
        prefill_cancel: Cancel | None = None,
    ) -> None:
        self.e = engine
        self.req = req
        self.cancel = cancel
        self.prefill_cancel = cancel if prefill_cancel is None else prefill_cancel
        self.on_token = on_token
        self.slot = req.slot
        spec = engine.settings.spec
        self.n_max = spec.n_max if req.spec_n_max is None else req.spec_n_max
        self.n_min = spec.n_min if req.spec_n_min is None else req.spec_n_min
        self.p_min = spec.p_min if req.spec_p_min is None else req.spec_p_min
        self.mode = spec.mode if self.n_max > 0 else "off"
        if (self.mode == "auto" or spec.adaptive) and req.spec_p_min is None:
            # the cost model caps the length; p_min only has to stop hopeless drafts (a
            # small draft model is often unsure of tokens the target then accepts)
            self.p_min = min(self.p_min, ADAPTIVE_P_MIN)
        self.sampler = Sampler(req.sampling, engine._tctx, engine.vocab.handle)
        self.result = GenerationResult(tokens=[], text="", stop_type="none")
        self.result.n_prompt = len(req.prompt)
        self.out: list[int] = []
        self.ngram: NgramIndex | None = None
        self.dbase: list[int] | None = None  # the draft's window of the prompt, once synced
        self._dgood = 0  # draft KV entries known to match dbase + out
        self._behind: int | None = None  # see _draft_behind
        self.draft_ok = engine._dcache is not None and self.mode in ("draft", "hybrid", "auto")
        self.pipelined = self.draft_ok and engine.pipeline_enabled(spec)
        self.pipe: DraftPipeline | None = None
        self._wait_ms = 0.0  # waiting for the draft thread (counts as llama.cpp time)
        self.policy = engine._policy_for(self.pipelined, spec, self.p_min)
        self.policy.n_max = max(self.n_max, 1)

    def close(self) -> None:
        self.sampler.close()

    # --- the request ---------------------------------------------------------------------
    def execute(self) -> GenerationResult:
        try:
            return self._execute()
        finally:
            if self.pipe is not None:
                self.pipe.stop()  # no wait: the next user of the draft cache joins it

    def _inside_ms(self) -> float:
        """llama.cpp time of this thread (a pipelined draft's runs on its own)."""
        e = self.e
        if self.pipe is not None:
            return e._clock.inside_ms + self._wait_ms
        return e._clock.inside_ms + e._dclock.inside_ms

    def _execute(self) -> GenerationResult:
        e, req, res = self.e, self.req, self.result
        t0 = time.perf_counter()
        settings = e.settings
        if not req.cache_prompt:
            e.clear_slot(self.slot)
        if self.pipelined and req.n_predict != 0:
            # the draft's window prefill runs beside the target's prompt prefill
            self._start_pipeline()
        else:
            e._settle_draft()
        inside0 = self._inside_ms()
        tcache = e._tcache
        held = tcache.tokens[self.slot]
        prompt: Sequence[int] = req.prompt
        if (
            req.n_predict == 0
            and len(held) > len(req.prompt)
            and held[: len(req.prompt)] == req.prompt
            and tcache.blocks_in_place(self.slot, req.blocks, req.block_sink)
        ):
            # a cache fill the slot already holds, and more: what follows stays (an editor's
            # ring warm-up must not drop the cursor's cached prefix and suffix behind the ring).
            # No logits are computed for it, unless an earlier KV shift left the held tokens
            # approximate and re-evaluating them fits the exactness budget: idle time repays it
            debt = len(held) - tcache.exact[self.slot]
            if debt <= 0 or not tcache.affordable(debt, settings.exact_ms):
                res.n_cached, res.stop_type = len(req.prompt), "limit"
                res.n_approx = max(0, len(req.prompt) - tcache.exact[self.slot])
                res.prompt_ms = (time.perf_counter() - t0) * 1000.0
                return res
            prompt = list(held)
        min_chunk = settings.cache_reuse if req.cache_prompt else 0
        pre = tcache.prefill(
            self.slot,
            prompt,
            blocks=req.blocks,
            sink=req.block_sink,
            min_chunk=min_chunk,
            tail_min=settings.tail_reuse,
            max_drift=settings.tail_max_drift,
            tail_refresh=settings.tail_refresh,
            tail_roll=settings.tail_roll,
            cancel=self.prefill_cancel,
            chunk=settings.prefill_chunk,
            exact_ms=settings.exact_ms,
        )
        res.n_cached = min(pre.n_cached, len(req.prompt))  # a repair may evaluate past it
        res.n_evaluated, res.n_shifted = pre.n_evaluated, pre.n_moved
        res.n_approx = max(0, len(req.prompt) - pre.n_exact)
        t1 = time.perf_counter()
        res.prompt_ms = (t1 - t0) * 1000.0
        if not pre.cancelled and not self.pipelined:  # a pipelined draft shares the cores
            self.policy.observe_target_prefill(pre.n_evaluated, res.prompt_ms)
        if pre.cancelled or (self.cancel is not None and self.cancel.is_set()):
            res.cancelled = True
        elif req.n_predict == 0:
            res.stop_type = "limit"
        else:
            self._decode_loop()
        t2 = time.perf_counter()
        if self.pipe is not None:
            self._pipeline_stats()
            res.predicted_ms = (t2 - t1) * 1000.0
        else:
            res.predicted_ms = (t2 - t1) * 1000.0 - res.draft_prompt_ms
            res.prompt_ms += res.draft_prompt_ms
            res.t_draft_ms = max(0.0, res.t_draft_ms - res.draft_prompt_ms)
        res.tokens = list(self.out)
        res.threads = e._tctx.threads_now
        res.t_outside_ms = max(0.0, (t2 - t0) * 1000.0 - (self._inside_ms() - inside0))
        return res

    def _start_pipeline(self) -> None:
        e = self.e
        assert e._dcache is not None and e._dctx is not None
        base = self._draft_window()
        if any(t >= e._dctx.n_vocab for t in base):  # a target-only (padding) id
            self.draft_ok = False
            e._settle_draft()
            return
        settings = e.settings
        self.dbase = base
        self.pipe = DraftPipeline(
            e._dcache,
            self.slot,
            base,
            p_min=self.p_min,
            p_chain=PIPELINE_P_CHAIN,
            ahead=min(settings.spec.pipeline_ahead, max(self.n_max, 1)),
            n_ctx=e.draft_n_ctx,
            n_target_vocab=e.vocab.n_vocab,
            prefill={
                "min_chunk": settings.cache_reuse if self.req.cache_prompt else 0,
                "tail_min": settings.tail_reuse,
                "max_drift": settings.tail_max_drift,
                "tail_refresh": settings.tail_refresh,
                "chunk": settings.prefill_chunk,
            },
            previous=e._draft_job,
        )
        e._draft_job = self.pipe
        self.pipe.start()

    def _pipeline_stats(self) -> None:
        """What the draft thread had done when the request ended (it ran concurrently)."""
        pipe, res = self.pipe, self.result
        assert pipe is not None
        res.pipelined = True
        res.draft_prompt_ms = pipe.prefill_ms
        pre = pipe.prefill_result
        if pre is not None:
            res.draft_n_cached = pre.n_cached
            res.draft_n_evaluated = pre.n_evaluated
            res.draft_n_shifted = pre.n_moved
        res.t_draft_ms = pipe.decode_ms
        res.draft_n_decoded = pipe.n_decoded

    def _decode_loop(self) -> None:
        e, req, res = self.e, self.req, self.result
        tcache = e._tcache
        slot = self.slot
        stops = StopRules(
            stop=req.stop,
            n_predict=req.n_predict,
            n_indent=req.n_indent,
            t_max_predict_ms=req.t_max_predict_ms,
        )
        self.stops = stops
        if self.mode != "off":
            self.ngram = NgramIndex(req.prompt, n_min=e.settings.spec.ngram_min)
        ts = time.perf_counter()
        last = self.sampler.sample(-1)
        res.t_sample_ms += (time.perf_counter() - ts) * 1000.0
        events: list[TokenEvent] = []
        stop = self._emit(last, len(tcache.tokens[slot]), events, self._probs(-1, last))
        if self.pipe is not None:
            self.pipe.confirm([last])
        self._deliver(events)
        while not stop:
            if self.cancel is not None and self.cancel.is_set():
                res.cancelled = True
                break
            n_before = len(tcache.tokens[slot])
            room = e.n_ctx - n_before - 2  # keep one cell free after the batch (llama-server)
            room = min(room, e.n_batch - 1)  # the verify batch is [last, *draft]
            if req.n_predict >= 0:
                room = min(room, req.n_predict - len(self.out) - 1)
            source, key, draft = self._propose(room)
            batch = [last, *draft]
            tv = time.perf_counter()
            tcache.append(slot, batch, logits="all" if draft else "last")
            dt = (time.perf_counter() - tv) * 1000.0
            res.t_verify_ms += dt
            self.policy.observe_target(len(batch), dt)
            ts = time.perf_counter()
            accepted = 0
            new_tokens: list[int] = []
            new_probs: list[TokenProbs | None] = []
            for j in range(len(batch)):
                tok = self.sampler.sample(j if draft else -1)
                new_tokens.append(tok)
                new_probs.append(self._probs(j if draft else -1, tok))
                if j < len(draft) and tok == draft[j]:
                    accepted += 1
                    continue
                break
            res.t_sample_ms += (time.perf_counter() - ts) * 1000.0
            if draft:
                st = res.drafted.setdefault(source, DraftStats())
                st.drafted += len(draft)
                st.accepted += accepted
                self.policy.observe_result(key, len(draft), accepted)
                res.spec_steps.append((source, len(draft), accepted))
            self.policy.tick()
            events = []
            n_emitted = 0
            for tok, probs in zip(new_tokens, new_probs, strict=True):
                n_emitted += 1
                stop = self._emit(tok, n_before + n_emitted, events, probs)
                if stop:
                    break
            if self.pipe is not None:
                self.pipe.confirm(new_tokens[:n_emitted])
            # KV keeps everything emitted except the newest token (it is not decoded yet)
            tcache.truncate(slot, n_before + n_emitted)
            self._sync_draft_after_step()
            last = self.out[-1]
            self._deliver(events)
        if res.cancelled or not stop:
            tail = stops.flush()
            if tail and self.on_token is not None and self.out:
                self.on_token(TokenEvent(self.out[-1], tail))
        res.text = stops.text
        res.stop_type = stops.stop_type if not res.cancelled else "none"
        res.stopping_word = stops.stopping_word

    def _probs(self, idx: int, tok: int) -> TokenProbs | None:
        """The request's n_probs report for ``tok`` (None when it asked for none)."""
        n = self.req.n_probs
        return self.sampler.probs(idx, tok, n) if n > 0 else None

    def _emit(
        self, tok: int, n_kv_before: int, events: list[TokenEvent], probs: TokenProbs | None
    ) -> bool:
        """Account one emitted token (stop rules); the text goes to ``events``."""
        self.out.append(tok)
        if probs is not None:
            self.result.probs.append(probs)
        if self.ngram is not None:
            self.ngram.extend((tok,))
        e = self.e
        outcome = self.stops.push(
            e.vocab.piece(tok),
            is_eog=tok in e.vocab.eog,
            context_full=n_kv_before + 1 >= e.n_ctx,
        )
        text = outcome.text
        if outcome.stop:
            text += self.stops.flush()
        events.append(TokenEvent(tok, text, probs))
        return outcome.stop

    def _deliver(self, events: list[TokenEvent]) -> None:
        if self.on_token is not None:
            for ev in events:
                self.on_token(ev)

    # --- drafting ------------------------------------------------------------------------
    def _propose(self, room: int) -> tuple[str, str, list[int]]:
        """Pick a draft for this step: (source for stats, key for the policy, tokens);
        no tokens means a plain step."""
        res = self.result
        if self.mode == "off" or room < 1 or self.ngram is None:
            return "", "", []
        auto = self.mode == "auto" or self.e.settings.spec.adaptive
        n_max = min(self.n_max, room)
        n_min = max(self.n_min, 1)
        td = time.perf_counter()
        source, key, draft = "", "", []
        if self.mode in ("ngram", "hybrid", "auto"):
            draft, match = self.ngram.draft(n_max)
            source, key = "ngram", ngram_source(match)
            if auto and draft:
                draft = draft[: self.policy.plan(key)]
        if self.pipe is not None:
            if self.draft_ok and self.mode in ("draft", "hybrid", "auto"):
                cand = self._pipelined_draft(n_max, auto)
                if len(cand) >= n_min and self._prefer_draft(cand, key, draft, auto):
                    source = key = "draft"
                    draft = cand
        elif len(draft) < n_min:
            source, key, draft = "", "", []
            if self.draft_ok and self.mode in ("draft", "hybrid", "auto"):
                k = n_max
                if auto:
                    probe_ok = self._draft_probe_is_cheap()
                    k = min(k, self.policy.plan("draft", allow_probe=probe_ok))
                    if k >= n_min and self.dbase is None and not self._draft_prefill_pays():
                        self.draft_ok = False  # for this request: n-grams or plain steps
                        k = 0
                if k >= n_min:
                    draft = self._draft_with_fallback(k)
                    source = key = "draft"
                    if not draft:  # the draft model paid a decode and was unsure: a miss
                        self.policy.observe_result("draft", 1, 0)
        if len(draft) < n_min:
            source, key, draft = "", "", []
        res.t_draft_ms += (time.perf_counter() - td) * 1000.0
        return source, key, draft

    def _pipelined_draft(self, n_max: int, auto: bool) -> list[int]:
        """What the draft thread has ready; its cost is hidden, so the policy only weighs
        the longer verify batch against the expected accepted run."""
        pipe = self.pipe
        assert pipe is not None
        if not pipe.usable:
            self.draft_ok = False
            return []
        if auto:
            # a switched-off draft model stops drafting ahead (it slows the target's memory
            # traffic); it restarts a couple of steps before its probe is due
            pipe.set_active(not self.policy.is_off("draft", lead=2))
        tw = time.perf_counter()
        avail = pipe.proposals(n_max, wait_for=self.e.settings.spec.pipeline_wait)
        self._wait_ms += (time.perf_counter() - tw) * 1000.0
        if not auto or not avail:
            return avail
        return avail[: self.policy.plan("draft", limit=len(avail))]

    def _prefer_draft(self, cand: list[int], ngram_key: str, ngram: list[int], auto: bool) -> bool:
        """Pipelined: the draft model's tokens or the n-gram's? "hybrid" keeps llama-server's
        n-gram-first rule; "auto" takes the larger expected gain."""
        if len(ngram) < max(self.n_min, 1):
            return True
        if not auto:
            return False
        return self.policy.gain("draft", len(cand)) > self.policy.gain(ngram_key, len(ngram))

    def _draft_window(self) -> list[int]:
        e = self.e
        prompt = self.req.prompt
        start = draft_window_start(len(prompt), e.settings.spec.draft_window)
        base = list(prompt[start:])
        if len(base) + len(self.out) + self.n_max + 2 > e.draft_n_ctx:
            base = base[-max(1, e.draft_n_ctx - len(self.out) - self.n_max - 2) :]
        return base

    def _draft_probe_is_cheap(self) -> bool:
        """A probe of a switched-off draft model must not first pay for a prompt prefill
        or a long catch-up on the tokens emitted since it last ran."""
        if self.dbase is None:
            return self._draft_prefill_is_cheap()
        assert self.e._dcache is not None
        behind = len(self.dbase) + len(self.out) - len(self.e._dcache.tokens[self.slot])
        return behind <= CHEAP_DRAFT_CATCHUP

    def _draft_prefill_is_cheap(self) -> bool:
        """Whether the draft's cache already holds most of this request's window (then a
        probe costs a few tokens, not a prompt prefill)."""
        return self._draft_behind() <= CHEAP_DRAFT_PREFILL

    def _draft_behind(self) -> int:
        """Prompt tokens the draft model would evaluate to catch up on this request."""
        if self._behind is None:
            e = self.e
            assert e._dcache is not None
            plan = e._dcache.plan(
                self.slot,
                self._draft_window(),
                min_chunk=e.settings.cache_reuse if self.req.cache_prompt else 0,
                tail_min=e.settings.tail_reuse,
                tail_refresh=e.settings.tail_refresh,
            )
            self._behind = plan.n_evaluated
        return self._behind

    def _draft_prefill_pays(self) -> bool:
        """Auto mode: is the draft's prompt prefill repaid over what is left to generate?
        (``t_max_predict_ms`` ends a completion at the first newline past that time.)"""
        behind = self._draft_behind()
        if behind <= CHEAP_DRAFT_PREFILL:
            return True
        req, t1 = self.req, self.policy.verify.t1
        horizon = req.n_predict - len(self.out) if req.n_predict > 0 else UNBOUNDED_HORIZON
        if req.t_max_predict_ms > 0 and t1 > 0:
            horizon = min(horizon, int(req.t_max_predict_ms / t1) + LINE_TOKENS)
        return self.policy.prefill_pays(behind, horizon)

    def _draft_target_seq(self) -> list[int]:
        assert self.dbase is not None
        return self.dbase + self.out

    def _sync_draft(self) -> bool:
        """Bring the draft's cache in step with the prompt window + emitted tokens (lazy: a
        request that never drafts with the model never pays for the draft's prefill)."""
        e, res = self.e, self.result
        dcache = e._dcache
        assert dcache is not None
        if self.dbase is None:
            base = self._draft_window()
            if any(t >= e._dctx.n_vocab for t in base):  # a target-only (padding) id
                self.draft_ok = False
                return False
            tp = time.perf_counter()
            pre = dcache.prefill(
                self.slot,
                base,
                min_chunk=e.settings.cache_reuse if self.req.cache_prompt else 0,
                tail_min=e.settings.tail_reuse,
                max_drift=e.settings.tail_max_drift,
                tail_refresh=e.settings.tail_refresh,
                tail_roll=e.settings.tail_roll,
                cancel=self.cancel,
                chunk=e.settings.prefill_chunk,
            )
            spent = (time.perf_counter() - tp) * 1000.0
            res.draft_prompt_ms += spent
            if not pre.cancelled:
                self.policy.observe_draft_prefill(pre.n_evaluated, spent)
            res.draft_n_cached += pre.n_cached
            res.draft_n_evaluated += pre.n_evaluated
            res.draft_n_shifted += pre.n_moved
            if pre.cancelled:
                return False
            self.dbase = base
        return True

    def _draft_with_fallback(self, k: int) -> list[int]:
        """A failing draft model (no KV cells left, ...) ends drafting, not the request."""
        try:
            return self._draft_model(k)
        except DecodeError:
            assert self.e._dcache is not None
            self.e._dcache.clear(self.slot)
            self.draft_ok = False
            self.dbase = None
            return []

    def _draft_model(self, k: int) -> list[int]:
        e = self.e
        dcache = e._dcache
        dctx = e._dctx
        assert dcache is not None and dctx is not None
        if not self._sync_draft():
            return []
        seq = self._draft_target_seq()
        have = dcache.tokens[self.slot]
        if len(seq) + k + 1 > e.draft_n_ctx:
            k = e.draft_n_ctx - len(seq) - 1
            if k < 1:
                self.draft_ok = False
                return []
        pending = seq[len(have) :]
        if any(t >= dctx.n_vocab for t in pending):
            self.draft_ok = False
            return []
        # catch up on the tokens emitted since the draft last ran (one batch, usually 1-2)
        for i in range(0, len(pending), dctx.n_batch):
            dcache.append(self.slot, pending[i : i + dctx.n_batch], logits="last")
        proposals: list[int] = []
        n_target_vocab = e.vocab.n_vocab
        t0 = time.perf_counter()
        while True:
            row = dctx.logits(-1)
            tok = int(row.argmax())
            p = 1.0 / float(np.exp(row - row[tok]).sum())
            if p < self.p_min or tok >= n_target_vocab:
                break
            proposals.append(tok)
            if len(proposals) >= k:
                break
            dcache.append(self.slot, [tok], logits="last")
        if len(proposals) > 1:
            per_token = (time.perf_counter() - t0) * 1000.0 / (len(proposals) - 1)
            self.policy.observe_draft_cost("draft", per_token)
        return proposals

    def _sync_draft_after_step(self) -> None:
        """Drop the draft's KV for proposals the target rejected (never keep them)."""
        dcache = self.e._dcache
        if dcache is None or self.dbase is None or self.pipe is not None:
            return  # a pipelined draft cuts its own KV
        have = dcache.tokens[self.slot]
        seq = self._draft_target_seq()
        n = max(len(self.dbase), min(self._dgood, len(have)))  # before _dgood: checked already
        limit = min(len(have), len(seq) - 1)
        while n < limit and have[n] == seq[n]:
            n += 1
        dcache.truncate(self.slot, n)
        self._dgood = n

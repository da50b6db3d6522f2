"""One sequence being generated: its sampler, stop rules, drafts and the tokens it emitted.

A request's completions each live in one sequence of the target context: the first in the
slot's own sequence (its output stays cached for the next request), the others in extra
sequences that share the prompt's KV. Per step a completion offers ``[last, *draft]`` for the
scheduler's batch, then verifies the drafted tokens against its own sampler's draws at their
rows of the batch: accepted while the draw equals the drafted token, the first disagreement
emits the target's token, and rejected KV is removed. The sampler draws once per emitted
token in the same order with or without speculation, so the output is the target's own.
"""

from __future__ import annotations

import time

import numpy as np

from localspec.engine.cache import SeqState
from localspec.engine.errors import DecodeError
from localspec.engine.llama import Segment
from localspec.engine.ngram import NgramIndex
from localspec.engine.pair import ModelPair
from localspec.engine.pipeline import DraftPipeline
from localspec.engine.policy import SpecPolicy, ngram_source
from localspec.engine.sampling import Sampler
from localspec.engine.stops import StopRules
from localspec.engine.types import (
    Cancel,
    DraftStats,
    GenerationRequest,
    GenerationResult,
    IndexedTokenCallback,
    Rejection,
    TokenEvent,
    TokenProbs,
)

ADAPTIVE_P_MIN = 0.3
CHEAP_DRAFT_PREFILL = 64  # draft prompt tokens a probe of the draft model may cost
CHEAP_DRAFT_CATCHUP = 8  # emitted tokens the draft may be behind for a probe
UNBOUNDED_HORIZON = 256  # tokens a completion without n_predict is expected to run
LINE_TOKENS = 32  # tokens to the newline that ends a completion past t_max_predict_ms
# a pipelined draft keeps drafting past a token it is at least this sure of: free when the
# target then emits that token, about half a draft token late to catch up when it does not,
# so a low bar pays (bench/results/speculative/engine-md-00-*.json compares 0.1 with 0.3)
PIPELINE_P_CHAIN = 0.1
ENTROPY_DECAY = 0.5  # the entropy average's weight of the past: about the last two steps
REJECTION_CONTEXT = 256  # tokens before a rejected draft kept with it (spec.record_rejections)


def draft_window_start(n_prompt: int, window: int) -> int:
    """Where the draft model's view of a prompt begins.

    The start moves in steps of window/4, so while the prompt grows by a few tokens per
    keystroke the draft's cached window keeps its first token and plain prefix reuse works.
    """
    if window <= 0 or n_prompt <= window:
        return 0
    grain = max(1, window // 4)
    return -(-(n_prompt - window) // grain) * grain


class Completion:
    """One completion of one request, from its first token to its stop."""

    def __init__(
        self,
        pair: ModelPair,
        req: GenerationRequest,
        st: SeqState,
        *,
        index: int = 0,
        cancel: Cancel | None = None,
        on_token: IndexedTokenCallback | None = None,
        dst: SeqState | None = None,
        dslot: SeqState | None = None,
    ) -> None:
        """``st``: the target sequence it decodes in; ``dslot``: the slot's sequence in the
        draft context (None without a draft model); ``dst``: where it drafts (None: ``dslot``)."""
        self.pair = pair
        self.req = req
        self.index = index
        self.st = st
        self._dslot = dslot
        self._dst = dst if dst is not None else dslot
        self.cancel = cancel
        self.on_token = on_token
        self.slot = req.slot
        spec = pair.settings.spec
        self.n_max = spec.n_max if req.spec_n_max is None else req.spec_n_max
        self.n_min = spec.n_min if req.spec_n_min is None else req.spec_n_min
        self.p_min = spec.p_min if req.spec_p_min is None else req.spec_p_min
        self.mode = spec.mode if self.n_max > 0 else "off"
        self.auto = self.mode == "auto" or spec.adaptive
        if self.auto and req.spec_p_min is None:
            # the cost model caps the length; p_min only has to stop hopeless drafts (a
            # small draft model is often unsure of tokens the target then accepts)
            self.p_min = min(self.p_min, ADAPTIVE_P_MIN)
        if req.oracle is not None:
            self.p_min = 0.0  # the oracle knows which tokens pass, not the draft's confidence
        self.sampler = Sampler(req.sampling, pair.tctx, pair.vocab.handle, req.prompt)
        self.result = GenerationResult(tokens=[], text="", stop_type="none")
        self.result.n_prompt = len(req.prompt)
        self.out: list[int] = []
        self.last = -1  # the newest emitted token, not decoded yet
        self.stopped = False  # a stop rule ended it
        self.done = False  # stopped or cancelled
        self.stops: StopRules | None = None
        self.ngram: NgramIndex | None = None
        self.dbase: list[int] | None = None  # the draft's window of the prompt, once synced
        self._dgood = 0  # draft KV entries known to match dbase + out
        self._behind: int | None = None  # see _draft_behind
        self.draft_ok = pair.dcache is not None and self.mode in ("draft", "hybrid", "auto")
        self.pipe: DraftPipeline | None = None
        self._wait_ms = 0.0  # waiting for the draft thread (counts as llama.cpp time)
        self.policy: SpecPolicy = self._policy(pipelined=False)
        # this step's draft: source (stats), policy key, tokens
        self.source, self.key, self.draft = "", "", []
        self.model_k = 0  # draft-model tokens asked for, to be drafted in a shared batch
        # completions of the same request whose tokens so far equal this one's: they draw
        # from this sequence's rows instead of decoding their own (``lead``)
        self.followers: list[Completion] = []
        self.leader: Completion | None = None
        self._defer = False
        self._n_before = 0
        self.t_decode0 = 0.0
        self.entropy = 0.0  # the target's recent entropy (EMA, nats), when spec.entropy_max
        # positions in this step's draft-model draft of tokens drafted below p_min
        self._unsure: list[int] = []
        self._learn_p_min = self.auto and spec.learn_p_min and req.spec_p_min is None

    def _policy(self, *, pipelined: bool) -> SpecPolicy:
        policy = self.pair.policy_for(
            pipelined,
            self.pair.settings.spec,
            self.p_min,
            self.req.language,
            oracle=self.req.oracle is not None,
        )
        policy.n_max = max(self.n_max, 1)
        return policy

    @property
    def dst(self) -> SeqState:
        """Its sequence in the draft context."""
        assert self._dst is not None
        return self._dst

    @property
    def dslot(self) -> SeqState:
        """The slot's sequence in the draft context: the prompt's window is evaluated there
        (an extra completion copies it, and the next keystroke reuses it)."""
        assert self._dslot is not None
        return self._dslot

    def close(self) -> None:
        self.sampler.close()
        if self.pipe is not None:
            self.pipe.stop()  # no wait: the next user of the draft cache joins it

    # --- the draft thread --------------------------------------------------------------------
    def start_pipeline(self) -> bool:
        """Draft on the draft model's own thread (its window prefill runs beside the target's
        prompt prefill). False when this prompt cannot be drafted for."""
        pair = self.pair
        assert pair.dcache is not None and pair.dctx is not None
        base = self._draft_window()
        if any(t >= pair.dctx.n_vocab for t in base):  # a target-only (padding) id
            self.draft_ok = False
            return False
        spec = pair.settings.spec
        self.dbase = base
        self.policy = self._policy(pipelined=True)
        self.pipe = DraftPipeline(
            pair.dcache,
            self.dst,
            base,
            p_min=self.p_min,
            p_chain=PIPELINE_P_CHAIN,
            ahead=min(spec.pipeline_ahead, max(self.n_max, 1)),
            n_ctx=pair.draft_n_ctx,
            n_target_vocab=pair.vocab.n_vocab,
            prefill=pair.draft_prefill_policy(self.req.cache_prompt),
            previous=pair.draft_job,
        )
        pair.draft_job = self.pipe
        self.pipe.start()
        return True

    def unpipe(self) -> None:
        """Continue drafting on this thread (another sequence joined the batch)."""
        pipe = self.pipe
        if pipe is None:
            return
        self._pipeline_stats()
        self.pair.settle_draft()
        self.pipe = None
        self.policy = self._policy(pipelined=False)
        # the draft's cache holds verified tokens (some of its window, perhaps not all): the
        # next draft re-plans its window, under the same rule as a new request's
        self.dbase = None
        self._behind = None
        self._dgood = 0

    # --- decoding ------------------------------------------------------------------------------
    def begin(self, logits_index: int) -> None:
        """The first token, drawn from the prompt's last logits (batch index of the last
        decode); the completion then takes part in the steps until it stops."""
        req, res = self.req, self.result
        self.t_decode0 = time.perf_counter()
        self.stops = StopRules(
            stop=req.stop,
            n_predict=req.n_predict,
            n_indent=req.n_indent,
            t_max_predict_ms=req.t_max_predict_ms,
        )
        if self.mode != "off":
            self.ngram = NgramIndex(req.prompt, n_min=self.pair.settings.spec.ngram_min)
        ts = time.perf_counter()
        last = self.sampler.sample(logits_index)
        if self.pair.settings.spec.entropy_max > 0:
            self._observe_entropy(logits_index)
        res.t_sample_ms += (time.perf_counter() - ts) * 1000.0
        events: list[TokenEvent] = []
        stop = self._emit(last, len(self.st.tokens), events, self._probs(logits_index, last))
        if self.pipe is not None:
            self.pipe.confirm([last])
        self.last = last
        self._deliver(events)
        self.stopped = self.done = stop

    def room(self) -> int:
        """Draft tokens this step may carry."""
        pair, req = self.pair, self.req
        n_before = len(self.st.tokens)
        room = pair.n_ctx - n_before - 2  # keep one cell free after the batch (llama-server)
        room = min(room, pair.n_batch - 1)  # the verify batch is [last, *draft]
        if self.index > 0:
            room = min(room, pair.aux_room - (n_before - len(req.prompt)) - 2)
        if req.n_predict >= 0:
            room = min(room, req.n_predict - len(self.out) - 1)
        return room

    def end_past_budget(self) -> bool:
        """Stop now if ``t_max_predict_ms`` has passed (a time limit, mid-line; ``finish``
        hands out what was held back), with the completions that follow it (their tokens
        are its); returns whether it stopped."""
        if self.stops is None or self.done or not self.stops.past_budget():
            return False
        for c in (self, *self.followers):
            assert c.stops is not None
            c.stops.stop_type = "limit"
            c.done = True
        return True

    def cancelled(self) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            self.result.cancelled = True
            self.done = True
        return self.done

    def segment(self) -> Segment:
        """This step's tokens for the batch: ``[last, *draft]`` after the cached ones."""
        batch = [self.last, *self.draft]
        self._n_before = len(self.st.tokens)
        return Segment(batch, self._n_before, self.st.seq, "all" if self.draft else "last")

    def verify(self, base: int, step_ms: float) -> None:
        """After the step's decode: draw at this sequence's rows (from batch index ``base``),
        accept drafted tokens while the draw equals them, emit, drop rejected KV. Followers
        draw at the same rows before the rejected KV goes (one may accept more of the draft)."""
        pair = self.pair
        draft, n_before = self.draft, self._n_before
        pair.tcache.appended(self.st, [self.last, *draft])
        mine = self.take(base, step_ms, n_before)
        if self.pipe is not None:
            self.pipe.confirm(mine)
        if self.followers:
            self._lead(base, step_ms, n_before, draft, mine)
        # KV keeps everything emitted except the newest token (it is not decoded yet)
        pair.tcache.truncate(self.st, n_before + len(mine))
        self._sync_draft_after_step()

    def take(self, base: int, step_ms: float, n_before: int) -> list[int]:
        """Draw at the step's rows for ``[last, *draft]`` (from batch index ``base``) with this
        completion's sampler, emit through its stop rules; returns the tokens emitted."""
        res = self.result
        draft, source, key = self.draft, self.source, self.key
        res.t_verify_ms += step_ms
        ts = time.perf_counter()
        accepted = 0
        new_tokens: list[int] = []
        new_probs: list[TokenProbs | None] = []
        last_row = base + len(draft)
        for j in range(len(draft) + 1):
            idx = base + j if draft else last_row
            tok = self.sampler.sample(idx)
            if j < len(draft) and tok != draft[j] and self._close_enough(idx, draft[j]):
                tok = draft[j]
                res.draft_n_relaxed += 1
            new_tokens.append(tok)
            new_probs.append(self._probs(idx, tok))
            if j < len(draft) and tok == draft[j]:
                accepted += 1
                continue
            break
        if self.pair.settings.spec.entropy_max > 0:
            self._observe_entropy(base + len(new_tokens) - 1 if draft else last_row)
        res.t_sample_ms += (time.perf_counter() - ts) * 1000.0
        if draft and accepted < len(draft) and self.pair.settings.spec.record_rejections:
            self._record_rejection(draft, new_tokens)
        if draft:
            st = res.drafted.setdefault(source, DraftStats())
            st.drafted += len(draft)
            st.accepted += accepted
            self.policy.observe_result(key, len(draft), accepted)
            res.spec_steps.append((source, len(draft), accepted))
            if source == "draft":
                for j in self._unsure:
                    if j <= accepted:  # past the first rejection a token says nothing
                        self.policy.observe_unsure(j < accepted)
        self._unsure = []
        self.policy.tick()
        events: list[TokenEvent] = []
        n_emitted = 0
        stop = False
        for tok, probs in zip(new_tokens, new_probs, strict=True):
            n_emitted += 1
            stop = self._emit(tok, n_before + n_emitted, events, probs)
            if stop:
                break
        self.last = self.out[-1]
        self.draft = []
        self._deliver(events)
        self.stopped = self.done = stop
        return new_tokens[:n_emitted]

    def _observe_entropy(self, idx: int) -> None:
        """The entropy of the target's distribution at the step's last row (the one its own
        next token came from), averaged over recent steps."""
        row = self.pair.tctx.logits(idx)
        z = row - row.max()
        e = np.exp(z)
        total = float(e.sum())
        h = float(np.log(total) - float((e * z).sum()) / total)
        self.entropy = (
            h if self.entropy == 0.0 else ENTROPY_DECAY * self.entropy + (1 - ENTROPY_DECAY) * h
        )

    def _close_enough(self, idx: int, drafted: int) -> bool:
        """Relaxed acceptance (``spec.accept`` "topk"): the drafted token is among the target's
        ``accept_top_k`` likeliest at this row, with at least ``accept_p_min`` probability.
        The sampler drew (and accepted into its state) its own token: the output is no longer
        the target's, which the answer says. Never with a grammar, which the token must obey."""
        spec = self.pair.settings.spec
        if spec.accept != "topk" or self.sampler.grammar is not None:
            return False
        row = self.pair.tctx.logits(idx)
        top = row[drafted]
        if int(np.count_nonzero(row > top)) >= spec.accept_top_k:
            return False
        p = 1.0 / float(np.exp(row - top).sum())
        return p >= spec.accept_p_min

    def _record_rejection(self, draft: list[int], target: list[int]) -> None:
        """Keep the cut draft for the server's rejection file (opt-in)."""
        out = self.out[-REJECTION_CONTEXT:]
        prompt, need = self.req.prompt, REJECTION_CONTEXT - len(out)
        context = (list(prompt[max(0, len(prompt) - need) :]) if need > 0 else []) + out
        text = self.pair.vocab.detokenize
        self.result.rejections.append(
            Rejection(
                source=self.source,
                context=context,
                draft=list(draft),
                target=list(target),
                context_text=text(context),
                draft_text=text(draft),
                target_text=text(target),
            )
        )

    def _lead(
        self, base: int, step_ms: float, n_before: int, draft: list[int], mine: list[int]
    ) -> None:
        """The followers draw at this step's rows, each with its own sampler: the rows' logits
        are theirs too, as far as their tokens equal the drafted ones. One that emitted what
        this completion did follows on; one that parted (or outlives it) gets its own
        sequence, a copy of the KV its tokens have (before this step's rejected KV is
        dropped); followers that parted the same way follow the first of them."""
        out0 = len(self.out) - len(mine)  # every follower had this many tokens, as this one
        parted: list[Completion] = []
        going: list[Completion] = []
        for f in self.followers:
            f.draft, f.source, f.key = draft, self.source, self.key
            theirs = f.take(base, step_ms, n_before)
            f.result.n_followed += len(theirs)
            if not f.done and not self.done and theirs == mine:
                going.append(f)
            else:
                parted.append(f)
        self.followers = going
        for g in follow_alike(parted):
            self.pair.tcache.share_prefix(self.st, g.st, n_before + len(g.out) - out0)

    def finish(self) -> GenerationResult:
        """The result, once the completion stopped (or was cancelled)."""
        res, stops = self.result, self.stops
        if stops is not None:
            if res.cancelled or not self.stopped:
                tail = stops.flush()
                if tail and self.on_token is not None and self.out:
                    self.on_token(self.index, TokenEvent(self.out[-1], tail))
            res.text = stops.text
            res.stop_type = stops.stop_type if not res.cancelled else "none"
            res.stopping_word = stops.stopping_word
            res.predicted_ms = (time.perf_counter() - self.t_decode0) * 1000.0
        if self.pipe is not None:
            self._pipeline_stats()
        res.tokens = list(self.out)
        res.threads = self.pair.tctx.threads_now
        return res

    def _pipeline_stats(self) -> None:
        """What the draft thread had done (it ran concurrently)."""
        pipe, res = self.pipe, self.result
        assert pipe is not None
        res.pipelined = True
        res.draft_prompt_ms = pipe.prefill_ms
        pre = pipe.prefill_result
        if pre is not None:
            res.draft_n_cached = pre.n_cached
            res.draft_n_evaluated = pre.n_evaluated
            res.draft_n_shifted = pre.n_shifted
        res.t_draft_ms = pipe.decode_ms
        res.draft_n_decoded = pipe.n_decoded

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
        pair = self.pair
        assert self.stops is not None
        outcome = self.stops.push(
            pair.vocab.piece(tok),
            is_eog=tok in pair.vocab.eog,
            context_full=n_kv_before + 1 >= pair.n_ctx,
        )
        text = outcome.text
        if outcome.stop:
            text += self.stops.flush()
        events.append(TokenEvent(tok, text, probs))
        return outcome.stop

    def _deliver(self, events: list[TokenEvent]) -> None:
        if self.on_token is not None:
            for ev in events:
                self.on_token(self.index, ev)

    # --- drafting ------------------------------------------------------------------------
    def propose(self, room: int, *, defer_model: bool = False) -> None:
        """Pick this step's draft (``self.source``, ``self.key``, ``self.draft``); no tokens
        means a plain step. ``defer_model``: a draft-model draft is only asked for
        (``self.model_k`` tokens), to be made with the other sequences' in one draft batch
        (``draft_together``)."""
        self.model_k = 0
        self._defer = defer_model
        self.source, self.key, self.draft = self._propose(room)

    def _propose(self, room: int) -> tuple[str, str, list[int]]:
        res = self.result
        # the step costs of the threads the target runs on now
        self.policy.verify = self.pair.step_costs(self.pipe is not None)
        if self.mode == "off" or room < 1 or self.ngram is None:
            return "", "", []
        if self.req.oracle is not None and self.pipe is None:
            return self._oracle_draft(min(self.n_max, room))
        entropy_max = self.pair.settings.spec.entropy_max
        if entropy_max > 0 and self.entropy > entropy_max:
            return "", "", []  # the target is unsure here: its drafts would be rejected
        auto = self.auto
        n_max = min(self.n_max, room)
        n_min = max(self.n_min, 1)
        td = time.perf_counter()
        source, key, draft = "", "", []
        spec = self.pair.settings.spec
        weigh = auto and spec.weigh_sources
        if self.mode in ("ngram", "hybrid", "auto"):
            draft, match = self.ngram.draft(n_max, agree=spec.ngram_agree)
            source, key = "ngram", ngram_source(match)
            if auto and draft:
                draft = draft[: self.policy.plan(key)]
        if self.pipe is not None:
            if self.draft_ok and self.mode in ("draft", "hybrid", "auto"):
                cand = self._pipelined_draft(n_max, auto)
                if len(cand) >= n_min and self._prefer_draft(cand, key, draft, auto):
                    source = key = "draft"
                    draft = cand
        elif (weigh and self._model_beats(key, draft)) or (
            # weighed, a synced draft model was just priced; before it first runs in this
            # request, the usual rule (its prompt prefill weighed, probes) decides
            len(draft) < n_min and not (weigh and self.dbase is not None)
        ):
            ngram_pick = (source, key, draft) if len(draft) >= n_min else ("", "", [])
            source, key, draft = "", "", []
            if self.draft_ok and self.mode in ("draft", "hybrid", "auto"):
                k = n_max
                if auto and self.policy.model_too_costly(spec.draft_cost_max):
                    k = 0
                elif auto:
                    probe_ok = self._draft_probe_is_cheap()
                    k = min(k, self.policy.plan("draft", allow_probe=probe_ok))
                    if k >= n_min and self.dbase is None and not self._draft_prefill_pays():
                        self.draft_ok = False  # for this request: n-grams or plain steps
                        k = 0
                if k >= n_min and self._defer:
                    self.model_k = k  # asked; the step decides (draft_together makes them)
                elif k >= n_min:
                    draft = self.draft_with_fallback(k)
                    source = key = "draft"
                    if not draft:  # the draft model paid a decode and was unsure: a miss
                        self.policy.observe_result("draft", 1, 0)
            if len(draft) < n_min and not self.model_k:
                source, key, draft = ngram_pick
        if len(draft) < n_min:
            source, key, draft = "", "", []
        res.t_draft_ms += (time.perf_counter() - td) * 1000.0
        return source, key, draft

    def _model_beats(self, ngram_key: str, ngram: list[int]) -> bool:
        """Whether the draft model's draft is expected to yield more per ms than the n-gram
        draft on offer. The model must first catch up on the tokens it has not seen (the
        n-gram drafts' accepted runs, a new prompt's window): that batch is priced in from
        the draft's measured batch times, so a long n-gram run is not followed by a model
        draft that spends the time it saved."""
        policy = self.policy
        if not self.draft_ok or policy.model_too_costly(self.pair.settings.spec.draft_cost_max):
            return False
        k = policy.plan("draft", allow_probe=False)
        if k < max(self.n_min, 1):
            return False
        synced = self.dbase is not None
        behind = self._draft_lag() if synced else self._draft_behind() + len(self.out)
        extra = policy.catch_up_ms(behind)
        ngram_gain = policy.gain(ngram_key, len(ngram)) if ngram else policy.min_gain
        return policy.gain("draft", k, extra) > ngram_gain

    def _oracle_draft(self, n_max: int) -> tuple[str, str, list[int]]:
        """A benchmark's ceiling (engine/oracle.py): exactly the draft the target accepts, from
        the source that yields more per ms, or a plain step."""
        oracle = self.req.oracle
        assert oracle is not None and self.ngram is not None
        pos = len(self.out)
        ngram, match = self.ngram.draft(n_max)
        ngram_run = oracle.accepted(pos, ngram)
        model_ok = self.draft_ok and self.mode in ("draft", "hybrid", "auto")
        draft_run = min(oracle.draft_run(pos), n_max) if model_ok else 0
        td = time.perf_counter()
        draft_ms = oracle.draft_ms if oracle.draft_ms >= 0 else self.policy.source("draft").cost_ms
        source, k = oracle.choose(ngram_run, draft_run, self.policy.verify, draft_ms)
        out: tuple[str, str, list[int]] = ("", "", [])
        if source == "ngram":
            out = ("ngram", ngram_source(match), ngram[:k])
        elif source == "draft":
            out = ("draft", "draft", self.draft_with_fallback(k))
        self.result.t_draft_ms += (time.perf_counter() - td) * 1000.0
        return out if out[2] else ("", "", [])

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
        avail = pipe.proposals(n_max, wait_for=self.pair.settings.spec.pipeline_wait)
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
        pair = self.pair
        prompt = self.req.prompt
        start = draft_window_start(len(prompt), pair.settings.spec.draft_window)
        base = list(prompt[start:])
        if len(base) + len(self.out) + self.n_max + 2 > pair.draft_n_ctx:
            base = base[-max(1, pair.draft_n_ctx - len(self.out) - self.n_max - 2) :]
        return base

    def model_ready(self) -> bool:
        """Whether this step's draft-model tokens cost only their draft batches: asked for,
        and the draft's cache holds (nearly) all of the request's window. A shared step does
        not pay a draft prompt prefill (on the path of every sequence in it) for the few
        tokens it keeps; alone, ``_draft_prefill_pays`` weighs that prefill instead."""
        return self.model_k > 0 and (self.dbase is not None or self._draft_prefill_is_cheap())

    def _draft_probe_is_cheap(self) -> bool:
        """A probe of a switched-off draft model must not first pay for a prompt prefill
        or a long catch-up on the tokens emitted since it last ran."""
        if self.dbase is None:
            return self._draft_prefill_is_cheap()
        return self._draft_lag() <= CHEAP_DRAFT_CATCHUP

    def _draft_lag(self) -> int:
        """Tokens a synced draft model has not seen: what it emitted since it last ran."""
        assert self.dbase is not None
        return len(self.dbase) + len(self.out) - len(self.dst.tokens)

    def _draft_prefill_is_cheap(self) -> bool:
        """Whether the draft's cache already holds most of this request's window (then a
        probe costs a few tokens, not a prompt prefill)."""
        return self._draft_behind() <= CHEAP_DRAFT_PREFILL

    def _draft_behind(self) -> int:
        """Prompt tokens the draft model would evaluate to catch up on this request."""
        if self._behind is None:
            pair = self.pair
            assert pair.dcache is not None
            policy = pair.draft_prefill_policy(self.req.cache_prompt)
            self._behind = pair.dcache.plan(self.dslot, self._draft_window(), policy).n_evaluated
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

    def draft_seq(self) -> list[int]:
        assert self.dbase is not None
        return self.dbase + self.out

    def sync_draft(self) -> bool:
        """Bring the draft's cache in step with the prompt window + emitted tokens (lazy: a
        request that never drafts with the model never pays for the draft's prefill). The
        window is evaluated in the slot's sequence; an extra completion's sequence then shares
        its cells and catches up on its own tokens."""
        pair, res = self.pair, self.result
        dcache = pair.dcache
        assert dcache is not None
        pair.settle_draft()  # a draft thread may still run on the draft's cache
        if self.dbase is None:
            base = self._draft_window()
            if any(t >= pair.dctx.n_vocab for t in base):  # a target-only (padding) id
                self.draft_ok = False
                return False
            dslot = self.dslot
            extra = dslot is not self.dst  # an extra completion: it copies the slot's window
            # (which the slot may hold already, perhaps with the first completion's tokens after it)
            if not (extra and dslot.tokens[: len(base)] == base):
                tp = time.perf_counter()
                policy = pair.draft_prefill_policy(self.req.cache_prompt)
                pre = dcache.prefill(dslot, base, policy, cancel=self.cancel)
                spent = (time.perf_counter() - tp) * 1000.0
                res.draft_prompt_ms += spent
                if not pre.cancelled:
                    self.policy.observe_draft_prefill(pre.n_evaluated, spent)
                res.draft_n_cached += pre.n_cached
                res.draft_n_evaluated += pre.n_evaluated
                res.draft_n_shifted += pre.n_shifted
                if pre.cancelled:
                    return False
            if extra:
                dcache.share_prefix(dslot, self.dst, len(base))
            self.dbase = base
        return True

    def draft_with_fallback(self, k: int) -> list[int]:
        """A failing draft model (no KV cells left, ...) ends drafting, not the request."""
        try:
            return self._draft_model(k)
        except DecodeError:
            assert self.pair.dcache is not None
            self.pair.dcache.clear(self.dst)
            self.draft_ok = False
            self.dbase = None
            return []

    def _draft_model(self, k: int) -> list[int]:
        pair = self.pair
        dcache = pair.dcache
        dctx = pair.dctx
        assert dcache is not None and dctx is not None
        if not self.sync_draft():
            return []
        seq = self.draft_seq()
        dst = self.dst
        have = dst.tokens
        if len(seq) + k + 1 > pair.draft_n_ctx:
            k = pair.draft_n_ctx - len(seq) - 1
            if k < 1:
                self.draft_ok = False
                return []
        pending = seq[len(have) :]
        if any(t >= dctx.n_vocab for t in pending):
            self.draft_ok = False
            return []
        # catch up on the tokens emitted since the draft last ran (one batch, usually 1-2)
        for i in range(0, len(pending), dctx.n_batch):
            chunk = pending[i : i + dctx.n_batch]
            tc = time.perf_counter()
            dcache.append(dst, chunk, logits="last")
            self.policy.draft_batches.observe(len(chunk), (time.perf_counter() - tc) * 1000.0)
        proposals: list[int] = []
        self._unsure = []
        n_target_vocab = pair.vocab.n_vocab
        t0 = time.perf_counter()
        while True:
            row = dctx.logits(-1)
            tok = int(row.argmax())
            p = 1.0 / float(np.exp(row - row[tok]).sum())
            if tok >= n_target_vocab:
                break
            if p < self.p_min:
                if not (self._learn_p_min and self.policy.unsure_pays()):
                    break
                self._unsure.append(len(proposals))
            proposals.append(tok)
            if len(proposals) >= k:
                break
            tc = time.perf_counter()
            dcache.append(dst, [tok], logits="last")
            self.policy.draft_batches.observe(1, (time.perf_counter() - tc) * 1000.0)
        if len(proposals) > 1:
            per_token = (time.perf_counter() - t0) * 1000.0 / (len(proposals) - 1)
            self.policy.observe_draft_cost("draft", per_token)
        return proposals

    def _sync_draft_after_step(self) -> None:
        """Drop the draft's KV for proposals the target rejected (never keep them)."""
        dcache = self.pair.dcache
        if dcache is None or self.dbase is None or self.pipe is not None:
            return  # a pipelined draft cuts its own KV
        dst = self.dst
        have = dst.tokens
        seq = self.draft_seq()
        n = max(len(self.dbase), min(self._dgood, len(have)))  # before _dgood: checked already
        limit = min(len(have), len(seq) - 1)
        while n < limit and have[n] == seq[n]:
            n += 1
        dcache.truncate(dst, n)
        self._dgood = n


def follow_alike(completions: list[Completion]) -> list[Completion]:
    """Each completion still going follows the first one before it with the same tokens (one
    sequence decodes for both until their draws part, ``Completion._lead``); returns the
    ones that follow none, which decode in their own sequences."""
    leaders: list[Completion] = []
    for c in completions:
        c.leader = None
        if c.done:
            continue
        lead = next((ld for ld in leaders if ld.out == c.out), None)
        if lead is None:
            leaders.append(c)
        else:
            c.leader = lead
            lead.followers.append(c)
    return leaders


def draft_together(wants: list[Completion]) -> None:
    """The draft model's drafts for several sequences in one draft batch per token: each
    first catches up on what it emitted since it last drafted, then all draft greedily side
    by side, each while it is at least ``p_min`` sure, up to its ``model_k`` tokens."""
    synced = []
    for c in wants:  # the window's prefill first, where the draft's cache lags
        if c.sync_draft():
            synced.append(c)
        else:
            c.model_k = 0
    wants = synced
    if not wants:
        return
    pair = wants[0].pair
    dcache, dctx = pair.dcache, pair.dctx
    assert dcache is not None and dctx is not None
    t0 = time.perf_counter()
    going: list[Completion] = []
    catch_up: list[Segment] = []
    for c in wants:
        seq = c.draft_seq()
        k = min(c.model_k, pair.draft_n_ctx - len(seq) - 1)
        if len(c.dst.tokens) >= len(seq):  # logits come from decoding: redo the newest
            dcache.truncate(c.dst, len(seq) - 1)
        pending = seq[len(c.dst.tokens) :]
        if k < 1 or any(t >= dctx.n_vocab for t in pending) or len(pending) > dctx.n_batch:
            c.model_k = 0
            if k < 1 or len(pending) <= dctx.n_batch:
                c.draft_ok = False
            else:  # far behind (a long stretch without the model): catch up on its own
                c.draft = c.draft_with_fallback(k)
                c.source = c.key = "draft" if c.draft else ""
            continue
        c.model_k = k
        going.append(c)
        catch_up.append(Segment(pending, len(c.dst.tokens), c.dst.seq, "last"))
    segments = catch_up
    rows: list[int] = []
    try:
        while going:
            bases = dctx.decode_many(segments)
            for c, seg in zip(going, segments, strict=True):
                dcache.appended(c.dst, seg.tokens)
            rows = [b + len(seg.tokens) - 1 for b, seg in zip(bases, segments, strict=True)]
            nxt_going: list[Completion] = []
            segments = []
            for c, row_at in zip(going, rows, strict=True):
                row = dctx.logits(row_at)
                tok = int(row.argmax())
                p = 1.0 / float(np.exp(row - row[tok]).sum())
                if p < c.p_min or tok >= pair.vocab.n_vocab:
                    continue
                c.draft.append(tok)
                if len(c.draft) < c.model_k:
                    nxt_going.append(c)
                    segments.append(Segment([tok], len(c.dst.tokens), c.dst.seq, "last"))
            going = nxt_going
    except DecodeError:
        for c in wants:  # the draft model ends drafting for this request, not the request
            dcache.clear(c.dst)
            c.draft_ok, c.dbase, c.draft = False, None, []
    spent = (time.perf_counter() - t0) * 1000.0
    for c in wants:
        if not c.model_k:
            continue
        c.source = c.key = "draft"
        if not c.draft:  # the draft model paid a decode and was unsure: a miss
            c.policy.observe_result("draft", 1, 0)
        elif len(c.draft) > 1:
            c.policy.observe_draft_cost("draft", spent / len(c.draft))
        c.result.t_draft_ms += spent

"""The step loop: every active sequence advances in one llama.cpp batch per step.

A :class:`Task` is one request on one slot: its prompt is evaluated once, then each of its
completions decodes in a sequence of its own (the first in the slot's sequence, the others in
extra sequences that share the prompt's KV), except that completions whose tokens agree
share one sequence until they part (``Completion._lead``). Tasks on different slots run at
the same time.

The policy, step by step:

* A task starts as soon as its slot is free (a task for a busy slot waits without holding up
  the others) and, with extra completions, sequences are free for them.
* Each step is one batch holding, for every decoding sequence, its last token and its draft,
  and one piece (``prefill_chunk`` tokens; alone, with flash attention, as many as
  ``prefill_piece_ms`` buys: ``cache.Pieces``) of every prompt being evaluated, oldest first
  while the batch has room. A request that arrives while others decode starts at the next step; a
  long prompt (an editor's file switch) advances a piece per step instead of freezing the
  others (a step costs them at most the pieces in it); prompts that arrive together are
  evaluated together, one pass over the weights for all of them. On a CPU with flash
  attention the pieces go in a second batch of the step, after the decoding rows'
  (``ModelPair.pieces_apart``).
* A cancelled task's sequences stop at the next step; the others go on.
* An ``apart`` task (a budget answer: a short prompt of the cursor's nearest lines) is
  evaluated and decoded in spare sequences of its own, beside its slot, whose KV it leaves
  alone; a ``behind`` task (that slot's full prompt filling for the next keystroke) puts no
  piece into a step that evaluates another task's prompt, so the answer's prompt keeps to
  its budget, and a cache fill (``n_predict`` 0) waits while an answer runs apart.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from localspec.engine.cache import PrefillResult, SeqState
from localspec.engine.completion import Completion, draft_together, follow_alike
from localspec.engine.errors import DecodeError
from localspec.engine.llama import Segment
from localspec.engine.pair import ModelPair
from localspec.engine.policy import share_step
from localspec.engine.slot import Aux, Running, Slot, Task
from localspec.engine.types import (
    GenerationResult,
)

# the query rows of one tile of llama.cpp's CPU flash attention (GGML_FA_TILE_Q); a batch of
# fewer rows takes its row-by-row kernel
FA_TILE_ROWS = 64
# a fill behind a budget answer evaluates pieces of this many tokens (without flash attention,
# where a CPU's prompt speed does not depend on the piece size): the next keystroke waits for
# the piece in flight before it takes the slot, and an answer's decoding step carries no more
BEHIND_CHUNK = 32


def _with_held_context(prompt: Sequence[int], blocks: Sequence[int], held: SeqState) -> list[int]:
    """A ring warm-up's prompt (new blocks, then at most the start of the cursor's context)
    with the rest of the cursor's context the slot holds after its old blocks put back: the
    warm-up then moves that context behind the new ring (``_blocks_first``) instead of
    dropping it, and the next keystroke reuses it."""
    end = sum(blocks)
    if not blocks or not held.spans or end > len(prompt):
        return list(prompt)
    frame, tail = list(prompt[end:]), held.tokens[held.spans[-1][1] :]
    if len(tail) <= len(frame) or tail[: len(frame)] != frame:
        return list(prompt)
    return [*prompt[:end], *tail]


class Scheduler:
    """Runs tasks in steps; single-threaded (the engine's owner calls ``step``)."""

    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.waiting: deque[Task] = deque()
        self.running: list[Running] = []
        self.prefilling: list[Running] = []  # prompts being evaluated, oldest first
        self.slots = [
            Slot(i, pair.n_ctx, pair.tcache.slots[i], pair.dcache.slots[i] if pair.dcache else None)
            for i in range(pair.n_slots)
        ]
        taux = pair.tcache.aux
        # (the draft context, when there is one, has as many extra sequences as the target's)
        daux = pair.dcache.aux if pair.dcache is not None else [None] * len(taux)
        self._free_aux: list[Aux] = [Aux(t, d) for t, d in zip(taux, daux, strict=True)]

    # --- the owner's side ------------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Queue ``task``; bad requests raise ValueError here, before anything runs."""
        pair = self.pair
        if not task.requests:
            raise ValueError("a task needs at least one request")
        first = task.first
        pair.check_slot(first.slot)
        if len(task.requests) - (0 if task.apart else 1) > len(pair.tcache.aux):
            most = len(pair.tcache.aux) + (0 if task.apart else 1)
            raise ValueError(
                f"{len(task.requests)} completions asked; this engine decodes at most "
                f"{most} of one request at once{' apart from its slot' if task.apart else ''}"
            )
        n_prompt = len(first.prompt)
        if n_prompt == 0:
            raise ValueError("empty prompt")
        if n_prompt >= pair.n_ctx:
            from localspec.engine.errors import PromptTooLongError

            raise PromptTooLongError(
                f"prompt of {n_prompt} tokens does not fit the slot context of {pair.n_ctx}"
            )
        bad = [t for t in first.prompt if not 0 <= t < pair.vocab.n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range (n_vocab {pair.vocab.n_vocab})")
        self.waiting.append(task)
        if not task.apart:
            self.slots[first.slot].submitted(task)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def slot_busy(self, slot: int) -> bool:
        return self.slots[slot].run is not None

    @property
    def spare(self) -> int:
        """Spare sequences free now (for extra completions, or an ``apart`` task)."""
        return len(self._free_aux)

    def busy_besides(self, slot: int) -> bool:
        """Anything else running or waiting (a prompt of a client that left is evaluated on,
        as a cache fill, only while the engine would otherwise idle)."""
        return bool(self.waiting) or any(r.task.slot != slot for r in self.running)

    def step(self) -> bool:
        """One step: start what can start, then one batch for every active sequence and a
        piece of each prompt being evaluated. Returns whether work is left."""
        self._admit()
        self._end_alternatives()
        live = self._live()
        if len(self.running) > 1 or len(live) > 1:
            # the draft thread drafts (and prefills its window) for one sequence alone: beside
            # other requests or completions it would take cores from their shared steps
            for run in self.running:
                for c in run.completions:
                    c.unpipe()
        # a fill behind others waits while their prompts are evaluated (a budget answer's
        # prompt is sized to its budget) and rides along their decoding steps, a small piece
        # each: aborted keystroke after keystroke, the answers would starve it, and it is what
        # the next keystroke needs; a warm-up waits while an answer runs apart
        front = any(not r.task.behind for r in self.prefilling)
        apart = any(r.task.apart for r in self.running)
        filling = [
            r
            for r in self.prefilling
            if not (r.task.behind and front)
            and not (apart and not r.task.behind and r.task.first.n_predict == 0)
        ]
        pending = sum(len(r.piece.tokens) for r in filling if r.piece is not None)
        # pieces in a batch of their own add nothing to the decoding rows' step
        apart = bool(live and pending) and self.pair.pieces_apart
        self._drafts(live, 0 if apart else min(pending, self.pair.n_batch))
        segments = [c.segment() for c in live]
        n_tokens = sum(len(s.tokens) for s in segments)
        apart = apart and n_tokens + pending >= FA_TILE_ROWS  # (fewer: the row-by-row kernel)
        pieces: list[tuple[Running, Segment]] = []
        rows = 0 if apart else n_tokens  # in the pieces' batch
        for run in filling:  # oldest first, while the batch has room
            assert run.piece is not None
            if (rows or pieces) and rows + len(run.piece.tokens) > self.pair.n_batch:
                break
            pieces.append((run, run.piece))
            rows += len(run.piece.tokens)
        if not apart:
            self._decode(live, segments, pieces)
        elif self._decode(live, segments, []):
            self._decode([], [], pieces, shared=True)
        self._retire()
        return self.busy

    def _decode(
        self,
        live: list[Completion],
        segments: list[Segment],
        pieces: list[tuple[Running, Segment]],
        *,
        shared: bool = False,
    ) -> bool:
        """One llama.cpp batch: the decoding sequences' ``segments``, then prompt pieces
        (``shared``: the step ran other work in a batch of its own). Returns False when it
        failed: the tasks in it fail, not the engine."""
        batch = segments + [piece for _, piece in pieces]
        if not batch:
            return True
        try:
            t0 = time.perf_counter()
            bases = self.pair.tctx.decode_many(batch)
            step_ms = (time.perf_counter() - t0) * 1000.0
            if segments:  # (what a step of this many tokens costs, pieces included)
                n_tokens = sum(len(s.tokens) for s in batch)
                self.pair.observe_step(n_tokens, step_ms, pipelined=live[0].pipe is not None)
            for c, base in zip(live, bases, strict=False):
                c.verify(base, step_ms)
            # a piece alone in its step prices prompt tokens
            alone = len(batch) == 1 and not shared
            for (run, piece), base in zip(pieces, bases[len(segments) :], strict=True):
                run.shared = run.shared or not alone
                self._advance(run, base + len(piece.tokens) - 1, step_ms if alone else None)
        except BaseException as exc:
            self._fail_all(exc, live, [run for run, _ in pieces])
            return False
        return True

    def _end_alternatives(self) -> None:
        """Once a request's first completion has ended, an extra one past its
        ``t_max_predict_ms`` stops, mid-line (with the ones that follow it): the editor waits
        for the whole answer and shows the first, so an alternative that runs on without a
        newline (llama-server's time rule waits for one) would hold it up to ``n_predict``
        tokens. Each still gets the full budget."""
        for run in self.running:
            first, *extras = run.completions
            if not first.done:
                continue
            for c in extras:
                if c.leader is None:
                    c.end_past_budget()

    def _drafts(self, live: list[Completion], n_pieces: int) -> None:
        """Each sequence's draft for this step. Alone, it follows its own cost model; beside
        others or prompt pieces (``n_pieces`` tokens), the lengths come from the measured
        cost of a step of that many tokens (``share_step``), the draft model's cost included,
        and the draft model then drafts only the kept tokens, for all its sequences in one
        draft batch per token."""
        if len(live) + (n_pieces > 0) <= 1:
            for c in live:
                c.propose(c.room())
            return
        for c in live:
            c.propose(c.room(), defer_model=True)
        # fixed modes (llama-server's rule) keep their drafts; the cost model shares the rest.
        # A prompt piece's tokens are work done by the step as much as an emitted token.
        adaptive = [c for c in live if c.auto]
        fixed = n_pieces + sum(1 + len(c.draft) + c.model_k for c in live if not c.auto)
        for c in adaptive:
            if not c.model_ready():
                c.model_k = 0
        offers = [
            c.policy.source(c.key if c.draft else "draft").survival(len(c.draft) or c.model_k)
            for c in adaptive
        ]
        made = [not c.draft for c in adaptive]
        lengths = share_step(
            offers,
            self.pair.step_costs(False),
            others=fixed,
            made=made,
            draft_ms=self._draft_ms(live),
        )
        for c, k, by_model in zip(adaptive, lengths, made, strict=True):
            if by_model:
                c.model_k = k
            else:
                c.draft = c.draft[:k]
        draft_together([c for c in live if c.model_k])
        for c in live:
            if not c.draft:
                c.source = c.key = ""

    def _draft_ms(self, live: list[Completion]) -> float:
        """One draft batch's ms: measured, or, before that, the target's step scaled by the
        models' sizes (a draft model's decode is bound by reading its weights too)."""
        known = [c.policy.source("draft").cost_ms for c in live]
        if max(known) >= 0:
            return max(known)
        return self.pair.step_costs(False).t1 * self.pair.draft_size_ratio

    # --- starting ------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Start every waiting task whose slot is free and whose extra completions have
        sequences to decode in, in the order they came."""
        for task in list(self.waiting):
            if task.apart:
                if len(task.requests) > len(self._free_aux):
                    continue
            elif self.slot_busy(task.slot) or len(task.requests) - 1 > len(self._free_aux):
                continue
            self.waiting.remove(task)
            self._start(task)

    def _start(self, task: Task) -> None:
        pair = self.pair
        first = task.first
        slot = self.slots[task.slot]
        st = slot.target
        run = Running(task, time.perf_counter(), pair.inside_ms())
        if task.apart:
            run.home = self._free_aux.pop()
            st = run.home.target
        run.reserved = [self._free_aux.pop() for _ in range(len(task.requests) - 1)]
        self.running.append(run)
        if not task.apart:
            slot.started(run)
        try:
            if run.home is not None:  # (a spare sequence: what an earlier user left goes)
                pair.tcache.clear(st)
                if run.home.draft is not None and pair.dcache is not None:
                    pair.settle_draft()
                    pair.dcache.clear(run.home.draft)
            elif not first.cache_prompt:
                pair.clear_slot(task.slot)
            c = self._completion(run, 0, st)
            # (extra completions follow it while they agree)
            alone = len(self.running) == 1 and not self.waiting
            pipe = alone and not task.apart and first.n_predict != 0
            if pipe and c.draft_ok and pair.pipeline_enabled():
                # the draft's window prefill runs on its thread beside the target's prefill
                c.start_pipeline()
            prompt: Sequence[int] = first.prompt
            held = st
            policy = pair.prefill_policy(first.cache_prompt)
            blocks = () if task.apart else first.blocks  # (a spare sequence has no iso one)
            if task.behind and not pair.flash_attn:
                chunk = min(policy.chunk or pair.n_batch, BEHIND_CHUNK)
                policy = replace(policy, chunk=chunk, piece_ms=0.0)
            if (
                not task.apart
                and first.n_predict == 0
                and len(held.tokens) > len(first.prompt)
                and held.tokens[: len(first.prompt)] == first.prompt
                and pair.tcache.blocks_in_place(held, first.blocks, first.block_sink)
            ):
                # a cache fill the slot already holds, and more: what follows stays (an
                # editor's ring warm-up must not drop the cursor's cached prefix and suffix
                # behind the ring). No logits are computed for it, unless an earlier KV shift
                # left the held tokens approximate and re-evaluating them fits the exactness
                # budget: idle time repays it
                debt = len(held.tokens) - held.exact
                if debt <= 0 or not pair.tcache.affordable(debt, pair.settings.exact_ms):
                    res = c.result
                    res.n_cached, res.stop_type = len(first.prompt), "limit"
                    res.n_approx = max(0, len(first.prompt) - held.exact)
                    res.prompt_ms = (time.perf_counter() - run.t0) * 1000.0
                    self._complete(run, [res])
                    return
                prompt = list(held.tokens)
            elif first.n_predict == 0 and policy.min_chunk > 0:
                # a ring warm-up under a changed ring: the cursor's context moves behind it
                # (only where KV shifts may move it: else it would be evaluated again)
                prompt = _with_held_context(first.prompt, first.blocks, held)
            cancel = task.prefill_cancel if task.prefill_cancel is not None else task.cancel
            run.steps = pair.tcache.prefill_steps(
                st,
                prompt,
                policy,
                blocks,
                first.block_sink,
                cancel,
                alone=alone,
            )
            self.prefilling.append(run)
            self._advance(run, -1, None, first_piece=True)
        except BaseException as exc:
            self._fail(run, exc)

    def _completion(
        self, run: Running, index: int, st: SeqState, dst: SeqState | None = None
    ) -> Completion:
        task = run.task
        req = task.requests[index]
        if index > 0:
            cap = self.pair.aux_room - 1  # an extra completion's sequence has this many cells
            if req.n_predict < 0 or req.n_predict > cap:
                req = replace(req, n_predict=cap)
        c = Completion(
            self.pair,
            req,
            st,
            index=index,
            cancel=task.cancel,
            on_token=task.on_token,
            dst=dst,
            dslot=run.home.draft if run.home is not None else self.slots[task.slot].draft,
        )
        run.completions.append(c)
        return c

    def _advance(
        self, run: Running, logits_index: int, ms: float | None, *, first_piece: bool = False
    ) -> None:
        """Resume the prompt's evaluation after its piece was decoded (``logits_index``: the
        batch row of the piece's last token); at its end, the completions begin."""
        assert run.steps is not None
        try:
            run.piece = next(run.steps) if first_piece else run.steps.send(ms)
            return
        except StopIteration as done:
            pre: PrefillResult = done.value
        run.steps = run.piece = None
        if run in self.prefilling:
            self.prefilling.remove(run)
        run.pre = pre
        run.prompt_ms = (time.perf_counter() - run.t0) * 1000.0
        pair, task = self.pair, run.task
        first = task.first
        cancelled = task.cancel is not None and task.cancel.is_set()
        first_c = run.completions[0]
        if not pre.cancelled and not run.shared and first_c.pipe is None:
            # (a pipelined draft shares the cores; shared steps priced other work too)
            first_c.policy.observe_target_prefill(pre.n_evaluated, run.prompt_ms)
        self._fill_prompt_stats(run, first_c.result, 0)
        if pre.cancelled or cancelled or first.n_predict == 0:
            if pre.cancelled or cancelled:
                first_c.result.cancelled = True
            else:
                first_c.result.stop_type = "limit"
            first_c.done = True
            return
        slot_st = run.home.target if run.home is not None else self.slots[task.slot].target
        for index in range(1, len(task.requests)):
            aux = run.reserved.pop()
            run.aux.append(aux)
            pair.tcache.share_prefix(slot_st, aux.target, len(slot_st.tokens))
            c = self._completion(run, index, aux.target, aux.draft)
            self._fill_prompt_stats(run, c.result, index)
        for c in run.completions:
            c.begin(logits_index)
        follow_alike(run.completions)  # a request whose completions agree costs one's steps

    def _fill_prompt_stats(self, run: Running, res: GenerationResult, index: int) -> None:
        pre = run.pre
        assert pre is not None
        n_prompt = len(run.task.first.prompt)
        res.prompt_ms = run.prompt_ms
        if index == 0:
            res.n_cached = min(pre.n_cached, n_prompt)  # a repair may evaluate past it
            res.n_evaluated, res.n_shifted = pre.n_evaluated, pre.n_shifted
        else:  # the prompt's KV is shared with the first completion's
            res.n_cached = n_prompt
        # of the prompt's KV the slot holds (not all of it when cut short), what is not exact
        held = min(n_prompt, pre.n_cached + pre.n_evaluated)
        res.n_approx = max(0, held - pre.n_exact)

    # --- finishing ------------------------------------------------------------------------
    def _live(self) -> list[Completion]:
        live: list[Completion] = []
        for run in self.running:
            for c in run.completions:
                # a follower rides its leader's rows (they share the cancel, so a follower
                # never outlives a leader that did not part from it in a step)
                if c.stops is not None and not c.done and not c.cancelled() and c.leader is None:
                    live.append(c)
        return live

    def _retire(self) -> None:
        for run in list(self.running):
            if run.pre is None:  # its prompt is still being evaluated
                continue
            if all(c.done for c in run.completions):
                results = [c.finish() for c in run.completions]
                self._complete(run, results)

    def _complete(self, run: Running, results: list[GenerationResult]) -> None:
        pair = self.pair
        wall = (time.perf_counter() - run.t0) * 1000.0
        inside = pair.inside_ms() - run.inside0
        for res in results:
            res.t_outside_ms = max(0.0, wall - inside)
            if not res.threads[0]:
                res.threads = pair.tctx.threads_now
        self._close(run)
        run.task.results = results
        self._finish(run)

    def _close(self, run: Running) -> None:
        for c in run.completions:
            c.close()
        pair, n_prompt = self.pair, len(run.task.first.prompt)
        for index, aux in enumerate(run.aux, start=1):
            pair.tcache.release(aux.target, n_prompt)
            if aux.draft is not None and aux.draft.tokens and pair.dcache is not None:
                pair.settle_draft()  # (a finished request's draft thread may still run)
                window = run.completions[index].dbase if index < len(run.completions) else None
                pair.dcache.release(aux.draft, len(window or ()))
            self._free_aux.append(aux)
        self._free_aux.extend(run.reserved)  # a request that ended before its prompt was in
        run.aux, run.reserved = [], []
        home, run.home = run.home, None
        if home is not None:
            pair.tcache.release(home.target, 0)
            if home.draft is not None and pair.dcache is not None:
                pair.settle_draft()
                pair.dcache.release(home.draft, 0)
            self._free_aux.append(home)

    def _finish(self, run: Running) -> None:
        if run in self.running:
            self.running.remove(run)
        if run in self.prefilling:
            self.prefilling.remove(run)
        task = run.task
        task.done = True
        if not task.apart:
            self.slots[task.slot].ended(task)
        if task.on_done is not None:
            task.on_done(task)

    def _fail(self, run: Running, exc: BaseException) -> None:
        """One task failed: its slot starts over (its cache may be half-written)."""
        if run.steps is not None:
            run.steps.close()
            run.steps = None
        apart = run.task.apart  # (its own sequences are cleared as they are freed)
        self._close(run)
        with contextlib.suppress(DecodeError):
            if not apart:
                self.pair.clear_slot(run.task.slot)
        run.task.error = exc
        self._finish(run)

    def abort(self, exc: BaseException) -> None:
        """Fail every task, running or waiting (after an unexpected error in a step)."""
        for run in list(self.running):
            self._fail(run, exc)
        while self.waiting:
            task = self.waiting.popleft()
            task.error, task.done = exc, True
            if not task.apart:
                self.slots[task.slot].ended(task)
            if task.on_done is not None:
                task.on_done(task)

    def _fail_all(
        self, exc: BaseException, live: list[Completion], prefills: list[Running]
    ) -> None:
        """A batch failed: llama.cpp may keep part of it, so every task in it starts over."""
        runs = {id(r): r for r in self.running if any(c in live for c in r.completions)}
        for run in prefills:
            runs[id(run)] = run
        for run in runs.values():
            self._fail(run, exc)

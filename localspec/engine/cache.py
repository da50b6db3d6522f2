"""Per-sequence KV caches on one llama context: apply a reuse plan, evaluate, roll back.

Each slot is one sequence id and keeps the list of tokens whose KV it holds (position i
holds token i), in a :class:`SeqState`. A sequence of the slot's own (``scratch``) parks the
KV runs a plan moves: llama.cpp only accepts a batch that continues a sequence (positions
max+1...), so the runs that come after an edited middle are parked, the middle is evaluated,
and each run is re-attached when the evaluation reaches its position. With a unified KV
buffer, parking re-tags cells (no copy). Extra completions of a request (``n_cmpl``) decode
in ``aux`` sequences that share the prompt's cells with the slot (``share_prefix``: a re-tag
too); in the draft model's context, theirs share the slot's draft window the same way.

Blocks (``prefill(blocks=...)``): the prompt's leading spans are each evaluated on its own
(attending only to itself, in a third sequence of the slot's, ``iso``) and then joined to it;
everything after them attends to all. A block's KV then depends on its own tokens only, so a
block that moves (an editor's ring losing its oldest chunk) is moved by a KV shift and still
equals what a cold evaluation of the same layout computes, up to the rounding of K's
rotation.

A prefill is a generator of batch segments (``prefill_steps``): the scheduler evaluates each
piece, alone or in one batch with other sequences' pieces and decoding steps, and resumes it;
the KV operations between pieces run inside it. Every slot has its scratch and iso
sequences, so the prefills of several slots can be in progress at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Concatenate, ParamSpec

from localspec.engine.cache_plan import ReusePlan, Run, common_prefix, plan_reuse, refresh_window
from localspec.engine.errors import DecodeError
from localspec.engine.llama import Context, Segment
from localspec.engine.types import Cancel

# compact the KV buffer (Context.compact, a whole-state copy) before an evaluation when
# (holes below kept cells) x (tokens to evaluate) reaches this: without flash attention each
# hole below the highest used cell costs every evaluated token a dot product, and this sits a
# margin above the point where that outweighs the copy (bench/results/kvcompact/)
COMPACT_MIN_WORK = 64 * 1024
COMPACT_OFF = 1 << 62  # a threshold no prefill reaches
# prefill pieces shorter than this cost mostly fixed overhead: no sample for the token price
PRICE_MIN_PIECE = 32


def piece_end(pos: int, end: int, step: int) -> int:
    """Where the prefill piece from ``pos`` ends, on the way to ``end``: as many pieces as
    pieces of ``step`` tokens would take, all of one size. llama.cpp's CPU flash attention
    runs batches of 64 query rows and more through a tiled kernel and smaller ones row by row,
    several times dearer per row at depth, so a short last piece (308 tokens as 128 + 128 + 52)
    cost as much as a full one; balanced (3 x 103) every piece of a prompt longer than one
    step has at least half a step of rows."""
    left = end - pos
    if left <= step:
        return end
    n_pieces = -(-left // step)
    return pos + -(-left // n_pieces)


@dataclass
class Pieces:
    """How many prompt tokens a prefill's next piece holds.

    ``chunk`` while the pieces share steps with other work (a step of others' tokens is held
    up by at most that). After a piece that ran alone in its batch (nothing else to run), as
    many tokens as ``budget_ms`` buys at that piece's own price (measured at the prompt's
    depth), up to ``most``: llama.cpp's flash attention evaluates a prompt faster in fewer
    batches (each batch reads the weights again), and a GPU's batches are cheap per token up
    to its ubatch. The budget bounds how long a request that arrives meanwhile waits for the
    piece in flight. Without flash attention the piece size does not change the speed on a CPU
    (bench/results/speculative/history-20-*.json, history-31-*.json), so the engine passes no
    budget there and the small piece keeps a cancel quick."""

    chunk: int
    most: int
    budget_ms: float = 0.0
    price: float = -1.0  # ms per token of the last piece, when it ran alone; -1: none

    def size(self) -> int:
        if self.budget_ms <= 0 or self.price <= 0:
            return self.chunk
        return max(self.chunk, min(self.most, int(self.budget_ms / self.price)))

    def ran(self, n_tokens: int, ms: float | None) -> None:
        self.price = ms / n_tokens if ms is not None and n_tokens >= PRICE_MIN_PIECE else -1.0


# what a prefill generator yields (a piece to evaluate) and is sent back (the piece's decode
# time in ms when it ran alone, None when it shared a batch: then it prices nothing)
PrefillSteps = Generator[Segment, "float | None", "PrefillResult"]
P = ParamSpec("P")


@dataclass(frozen=True)
class PrefillPolicy:
    """How a prefill may reuse the cache: one value, built once from the engine's settings."""

    min_chunk: int = 0  # runs of at least this many tokens move by a KV shift; 0: prefix only
    tail_min: int = 0  # ... or this many when they end the prompt or the cache (a suffix block)
    max_drift: int = 1 << 30  # a moved suffix block is recomputed past this many changes
    tail_refresh: int = 0  # tokens at a moved suffix block's start evaluated afresh
    tail_roll: int = 0  # and a rolling window of this many further in, per prefill
    chunk: int | None = None  # tokens per evaluated piece (None: n_batch)
    exact_ms: float = 0.0  # an exact plan costing at most this many ms more is preferred
    # with flash attention, a piece after one that ran alone holds as many tokens as this many
    # ms buy at that piece's price (``Pieces``); 0: always ``chunk``
    piece_ms: float = 0.0


@dataclass
class PrefillResult:
    n_cached: int  # prompt tokens whose KV was kept (prefix + moved runs)
    n_evaluated: int  # prompt tokens decoded now
    n_shifted: int  # of n_cached, tokens moved by a KV shift (approximate reuse)
    cancelled: bool = False
    n_exact: int = 0  # leading tokens of the slot's KV equal to a cold evaluation's


@dataclass
class TailDrift:
    """How stale a moved suffix block is (see ``SlotCaches._tail_rule``)."""

    drift: int = 0  # tokens changed in front of the block since its stalest token was computed
    start: int = -1  # where the block begins (-1: none)
    changes: list[int] = field(default_factory=list)  # per prefill, rolling
    roll_at: int = 0  # offset of the next rolling refresh window


@dataclass
class SeqState:
    """What one sequence's KV holds and how it was built."""

    seq: int  # the llama.cpp sequence id
    scratch: int = -1  # a slot's: where a reuse plan parks the runs it moves
    iso: int | None = None  # a slot's: where its ring blocks are evaluated, each on its own
    tokens: list[int] = field(default_factory=list)  # position i holds tokens[i]
    # leading tokens whose KV a cold evaluation would compute bit for bit: everything from the
    # first moved run on attended to KV computed after other text
    exact: int = 0
    # the block spans the KV was built with ([] when causal throughout); ``tokens`` says how
    # much of them is present
    spans: list[tuple[int, int]] = field(default_factory=list)
    sink: bool = False  # whether those blocks saw the first one
    tail: TailDrift = field(default_factory=TailDrift)

    def reset_drift(self) -> None:
        self.tail = TailDrift()


def _after_blocks(
    cached: Sequence[int],
    old: Sequence[tuple[int, int]],
    prompt: Sequence[int],
    end: int,
    min_chunk: int,
) -> Run | None:
    """The run of what followed the old blocks (or, with none, the whole cache) that the
    prompt repeats right after its new blocks ``end``; None when shorter than ``min_chunk``.
    The prompt's last token stays out: it is evaluated for its logits."""
    src = old[-1][1] if old else 0
    n = common_prefix(cached[src:], prompt[end : len(prompt) - 1])
    return Run(src, end, n) if n >= max(1, min_chunk) else None


@dataclass
class _Placed:
    """What placing the blocks did: tokens evaluated, tokens moved, cut short."""

    evaluated: int = 0
    shifted: int = 0
    cancelled: bool = False

    def added_to(self, res: PrefillResult) -> PrefillResult:
        """``res`` (the reuse plan's, which counts the blocks as cached) with this work in."""
        if not (self.evaluated or self.shifted):
            return res
        return replace(
            res,
            n_cached=res.n_cached - self.evaluated,
            n_evaluated=res.n_evaluated + self.evaluated,
            n_shifted=res.n_shifted + self.shifted,
        )


def block_spans(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each block, from their lengths (laid end to end from position 0)."""
    spans: list[tuple[int, int]] = []
    start = 0
    for n in blocks:
        spans.append((start, start + n))
        start += n
    return spans


def drive(ctx: Context, steps: PrefillSteps) -> PrefillResult:
    """Run a prefill to its end, each piece alone in its own batch."""
    try:
        seg = next(steps)
        while True:
            t0 = time.perf_counter()
            ctx.decode_many([seg])
            seg = steps.send((time.perf_counter() - t0) * 1000.0)
    except StopIteration as done:
        return done.value


def driven(
    steps: Callable[Concatenate[SlotCaches, P], PrefillSteps],
) -> Callable[Concatenate[SlotCaches, P], PrefillResult]:
    """A prefill method run to its end (``drive``), taking the same arguments as ``steps``."""

    def run_to_end(self: SlotCaches, /, *args: P.args, **kwargs: P.kwargs) -> PrefillResult:
        return drive(self.ctx, steps(self, *args, **kwargs))

    run_to_end.__doc__ = f"``{steps.__name__}`` run to the end, each piece in a batch of its own."
    return run_to_end


class SlotCaches:
    """The sequences of one context: ``n_slots`` slots (each with its scratch sequence, and its
    iso sequence where ``iso``), then ``n_aux`` sequences for extra completions."""

    def __init__(
        self,
        ctx: Context,
        n_slots: int,
        *,
        n_aux: int = 0,
        iso: bool | None = None,
        compact_min_work: int = COMPACT_MIN_WORK,
    ) -> None:
        """``iso`` None: an iso sequence per slot when the context has room for them."""
        self.ctx = ctx
        self.compact_min_work = compact_min_work  # COMPACT_OFF: never compact
        self.n_slots = n_slots
        with_iso = ctx.n_seq >= 3 * n_slots if iso is None else iso
        self.slots = [
            SeqState(i, scratch=n_slots + i, iso=2 * n_slots + i if with_iso else None)
            for i in range(n_slots)
        ]
        first_aux = (3 if with_iso else 2) * n_slots
        self.aux = [SeqState(first_aux + j) for j in range(min(n_aux, ctx.n_seq - first_aux))]
        self.n_compacted = 0  # KV buffer compactions done by prefills
        # cells freed below cells that stay (moved runs and blocks keep their old cells), less
        # the new tokens since, which llama.cpp puts into the lowest free cells: an estimate of
        # the holes every evaluated token pays for until a compaction
        self.holes = 0
        self.ms_per_token = -1.0  # measured prefill price (EMA over pieces); -1: unmeasured

    def plan(self, st: SeqState, prompt: Sequence[int], policy: PrefillPolicy) -> ReusePlan:
        return plan_reuse(
            st.tokens,
            prompt,
            min_chunk=policy.min_chunk,
            tail_min=policy.tail_min,
            tail_refresh=policy.tail_refresh,
            can_shift=self.ctx.can_shift,
        )

    def prefill_steps(
        self,
        st: SeqState,
        prompt: Sequence[int],
        policy: PrefillPolicy,
        blocks: Sequence[int] = (),
        sink: bool = False,
        cancel: Cancel | None = None,
        alone: bool = False,
    ) -> PrefillSteps:
        """Make ``st`` hold ``prompt`` (logits of its last token ready); reuse what it can.

        ``alone``: nothing else runs as it starts, so its first piece may already be sized by
        ``policy.piece_ms`` (at the measured price), as the pieces after one that ran alone are.

        ``blocks``: lengths of the prompt's leading blocks, each evaluated on its own (module
        docstring); a cached block with the same tokens is moved into place, wherever it was
        (when the policy allows KV shifts at all: any block, whatever its length).
        Everything after them is planned as without blocks. ``sink``: every block after the
        first also attends to the first (a repository header, an attention sink), as if it
        stood right before it, so the block still moves exactly.

        ``policy.exact_ms``: when keeping the KV exact (prefix reuse of the exact part only,
        no KV shift) costs at most this many milliseconds more than the reuse plan, at the
        measured price per token, the exact plan is taken, and it also repays an earlier
        shift's approximation still held in the prefix."""
        pieces = self._pieces(policy, alone)
        placed = yield from self._blocks_first(
            st, prompt, blocks, sink=sink, min_chunk=policy.min_chunk, cancel=cancel, pieces=pieces
        )
        if placed.cancelled:
            n, done = len(st.tokens), placed.evaluated
            return PrefillResult(n - done, done, placed.shifted, True, st.exact)
        ctx, seq = self.ctx, st.seq
        plan = self._tail_rule(st, prompt, self.plan(st, prompt, policy), policy)
        cached = st.tokens
        exact = st.exact
        if policy.exact_ms > 0 and (plan.runs or plan.n_prefix > exact):
            # the exact plan: prefix reuse of the exact part only (plan.n_prefix is the common
            # prefix, already short of the last token), everything after it evaluated
            keep = min(plan.n_prefix, exact)
            if self.affordable(len(prompt) - keep - plan.n_evaluated, policy.exact_ms):
                plan = ReusePlan(keep, (), len(prompt), ((keep, len(prompt)),))
                st.reset_drift()
        n_shifted = sum(r.n for r in plan.runs)
        self._park(st, plan.runs, plan.n_prefix, len(cached) + len(prompt) + 1)
        todo = plan.n_evaluated
        toks = list(prompt[: plan.n_prefix])
        st.tokens = toks
        st.exact = min(exact, plan.n_prefix)
        runs = {r.dst: r for r in plan.runs}
        pos = plan.n_prefix
        n_prompt = len(prompt)
        cancelled = False
        while pos < n_prompt:
            run = runs.get(pos)
            if run is not None:
                self._unpark(st, run.dst, run.dst + run.n)
                toks.extend(prompt[run.dst : run.dst + run.n])
                pos += run.n
                continue
            nxt = min((d for d in runs if d > pos), default=n_prompt)
            if not cancelled and cancel is not None and cancel.is_set():
                cancelled = True
            if cancelled and not _worth_finishing(runs, pos, n_prompt):
                break
            # cancelled with parked runs ahead: finish the gaps in front of them and attach
            # them (then stop) when that is less work than recomputing them next time
            end = piece_end(pos, min(n_prompt, nxt), pieces.size())
            self._compact_if_due(todo)
            ms = yield Segment(prompt[pos:end], pos, seq, "last" if end == n_prompt else "none")
            self._evaluated(end - pos, ms, pieces)
            todo -= end - pos
            toks.extend(prompt[pos:end])
            pos = end
        if plan.runs:
            ctx.seq_rm(st.scratch, -1, -1)
        # the KV stays exact up to the first moved run (when it was exact up to the prefix)
        first_moved = min((r.dst for r in plan.runs if r.dst < len(toks)), default=len(toks))
        if exact >= plan.n_prefix:
            st.exact = first_moved
        if cancelled:
            # count the runs that were attached before the cancel as cached
            attached = sum(r.n for r in plan.runs if r.dst + r.n <= len(toks))
            n_eval = len(toks) - plan.n_prefix - attached
            return placed.added_to(
                PrefillResult(plan.n_prefix + attached, n_eval, attached, True, n_exact=st.exact)
            )
        return placed.added_to(
            PrefillResult(plan.n_reused, plan.n_evaluated, n_shifted, n_exact=st.exact)
        )

    prefill = driven(prefill_steps)

    def to_evaluate(
        self,
        st: SeqState,
        prompt: Sequence[int],
        policy: PrefillPolicy,
        blocks: Sequence[int] = (),
    ) -> int:
        """About how many of ``prompt``'s tokens a prefill of ``st`` would evaluate (a jump's
        cost, before it runs): blocks whose tokens the sequence holds as blocks move into
        place, the rest is planned as the prefill plans it."""
        spans = block_spans(blocks)
        if not spans or not st.spans:
            return self.plan(st, prompt, policy).n_evaluated
        held = {tuple(st.tokens[a:b]) for a, b in st.spans if b <= len(st.tokens)}
        missing = sum(b - a for a, b in spans if tuple(prompt[a:b]) not in held)
        end, held_end = spans[-1][1], st.spans[-1][1] if st.spans else 0
        rest = plan_reuse(
            st.tokens[held_end:],
            prompt[end:],
            min_chunk=policy.min_chunk,
            tail_min=policy.tail_min,
            tail_refresh=policy.tail_refresh,
            can_shift=self.ctx.can_shift,
        )
        return missing + rest.n_evaluated

    def _pieces(self, policy: PrefillPolicy, alone: bool) -> Pieces:
        n_batch = self.ctx.n_batch
        budget = policy.piece_ms if self.ctx.flash_attn else 0.0
        pieces = Pieces(max(1, min(policy.chunk or n_batch, n_batch)), n_batch, budget)
        if alone:
            pieces.price = self.ms_per_token
        return pieces

    def _tail_rule(
        self, st: SeqState, prompt: Sequence[int], plan: ReusePlan, policy: PrefillPolicy
    ) -> ReusePlan:
        """The plan with a short moved run that ends the prompt or the cache (a suffix block)
        kept under bounded drift: refreshed by a rolling window, or recomputed past the cap."""
        tail = plan.runs[-1] if plan.runs else None
        cached = st.tokens
        drift = st.tail
        if (
            tail is not None
            and tail.n < policy.min_chunk
            and (tail.dst + tail.n == len(prompt) - 1 or tail.src + tail.n == len(cached))
        ):
            # a short run ending the prompt or the cache, moved under the tail rule: bounded drift
            # tokens inserted and deleted in front of the block since its KV was computed
            # (the refreshed tokens at the block's start are recomputed, not changes)
            moved_before = sum(r.n for r in plan.runs[:-1]) + policy.tail_refresh
            inserted = tail.dst - plan.n_prefix - moved_before
            deleted = tail.src - plan.n_prefix - moved_before
            changed = max(0, inserted) + max(0, deleted)
            roll = policy.tail_roll
            if roll > 0:
                # with a rolling refresh the stalest token was recomputed one cycle ago
                per_cycle = -(-tail.n // roll)  # prefills to refresh the whole block
                recent = drift.changes[len(drift.changes) - (per_cycle - 1) :]
                total = sum(recent) + changed if per_cycle > 1 else changed
            else:
                total = drift.drift + changed
            if total > policy.max_drift:
                plan = self.plan(st, prompt, replace(policy, tail_min=len(prompt) + 1))
                st.reset_drift()
            else:
                drift.drift = total
                drift.start = tail.dst
                if roll > 0 and tail.dst + tail.n == len(prompt) - 1:  # a whole block
                    drift.changes = [*drift.changes[-63:], changed]
                    offset = drift.roll_at if drift.roll_at < tail.n else 0
                    plan = refresh_window(plan, offset, roll)
                    drift.roll_at = offset + roll
        elif not 0 <= drift.start < plan.n_prefix:
            # any moved tail block was dropped or recomputed: nothing stale remains
            st.reset_drift()
        return plan

    def blocks_in_place(self, st: SeqState, blocks: Sequence[int], sink: bool = False) -> bool:
        """Whether the sequence's KV was built with exactly these blocks, all present."""
        spans = block_spans(blocks)
        if st.spans != spans or (spans and st.sink != sink):
            return False
        return not spans or len(st.tokens) >= spans[-1][1]

    def _blocks_first(
        self,
        st: SeqState,
        prompt: Sequence[int],
        blocks: Sequence[int],
        *,
        sink: bool,
        min_chunk: int,
        cancel: Cancel | None,
        pieces: Pieces,
    ) -> Generator[Segment, float | None, _Placed]:
        """Put the prompt's blocks in place (none: undo an earlier request's blocks): leave
        ``st`` holding them, exact, and after them what it held after the old blocks as far
        as the prompt goes on the same (the cursor's code, under a ring that changed: moved
        by a KV shift when it is ``min_chunk`` tokens or more, approximate, for the reuse
        plan and its exact-KV budget to judge), unless they are in place already (then the
        cache is untouched)."""
        blocks = list(blocks)
        while blocks and sum(blocks) >= len(prompt):  # the last token is evaluated with logits
            blocks.pop()
        if not blocks:
            if st.spans:
                self._unblock(st)
            return _Placed()
        if st.iso is None:
            raise ValueError("blocks need a context with a sequence for them (n_seq)")
        move = min_chunk > 0 and self.ctx.can_shift  # min_chunk 0: no KV shift at all
        spans = block_spans(blocks)
        end = spans[-1][1]
        ctx, seq, iso = self.ctx, st.seq, st.iso
        assert iso is not None
        cached, old = st.tokens, st.spans
        if st.sink != sink:  # blocks built with another rule do not match
            old = []
        st.sink = sink
        if old == spans and len(cached) >= end and cached[:end] == list(prompt[:end]):
            return _Placed()
        head = list(prompt[: spans[0][1]]) if sink else []  # the sink: the first block

        def same(k: int) -> bool:
            (s, e), (so, eo) = spans[k], old[k]
            return so == s and eo == e and e <= len(cached) and cached[s:e] == list(prompt[s:e])

        k = 0  # leading blocks still in place
        while k < min(len(spans), len(old)) and same(k):
            k += 1
        start = spans[k][0] if k < len(spans) else end
        # a block cut short in place (a cancelled prefill) resumes where it stopped
        if (
            k < min(len(spans), len(old))
            and old[k][0] == start
            and start < len(cached) < min(old[k][1], spans[k][1])
            and cached[start:] == list(prompt[start : len(cached)])
        ):
            start = len(cached)
        pool: dict[tuple[int, ...], list[int]] = {}  # whole cached blocks by their tokens
        part: tuple[int, ...] = ()  # the start of a block a cancel cut short (depends on it only)
        part_at = 0
        for s, e in old[k:]:
            if e <= len(cached) and s >= start:
                pool.setdefault(tuple(cached[s:e]), []).append(s)
            elif s >= start and s < len(cached) < e:
                part, part_at = tuple(cached[s:]), s
        moves: dict[int, Run] = {}
        for s, e in spans[k:]:
            sources = pool.get(tuple(prompt[s:e])) if move else None
            if sources and s >= start:
                moves[s] = Run(sources.pop(0), s, e - s)
            elif move and part and s >= start and tuple(prompt[s : s + len(part)]) == part:
                # the ring turned again before the block was done (an editor's next warm-up):
                # its evaluated start moves along and the block resumes where it stopped
                moves[s] = Run(part_at, s, min(len(part), e - s))
                part = ()
        after = _after_blocks(cached, old, prompt, end, min_chunk) if move else None
        parked = [*moves.values(), *([after] if after else [])]
        self._park(st, parked, start, len(cached) + len(prompt) + 1)
        toks = list(prompt[:start])
        st.tokens, st.spans = toks, spans
        st.reset_drift()
        placed = _Placed()
        pos = start
        for s, e in spans[k:]:
            run = moves.get(s)
            if run is not None:
                pos = s + run.n
                self._unpark(st, s, pos)
                toks.extend(prompt[s:pos])
                placed.shifted += run.n
                if pos == e:
                    continue
            ctx.seq_rm(iso, -1, -1)
            ready = False
            while pos < e:
                if cancel is not None and cancel.is_set():
                    placed.cancelled = True
                    break
                if not ready:  # (after the check: a request cut short already decodes nothing)
                    if head and s > 0:  # a copy of the sink right before the block, for it only
                        yield Segment(head, s - len(head), iso, "none")
                    if pos > s:  # the block's evaluated start goes along: the rest attends to it
                        ctx.seq_cp(seq, iso, s, pos)
                    ready = True
                nxt = piece_end(pos, e, pieces.size())
                # what follows the blocks attends to this one: it is evaluated after it too
                self._compact_if_due(len(prompt) - pos)
                ms = yield Segment(prompt[pos:nxt], pos, iso, "none")
                self._evaluated(nxt - pos, ms, pieces)
                ctx.seq_cp(iso, seq, pos, nxt)
                toks.extend(prompt[pos:nxt])
                placed.evaluated += nxt - pos
                pos = nxt
            ctx.seq_rm(iso, -1, -1)
            if placed.cancelled:
                break
        st.exact = len(toks)  # every block present is as a cold evaluation makes it
        if after is not None and not placed.cancelled:
            self._unpark(st, end, end + after.n)
            toks.extend(prompt[end : end + after.n])
            placed.shifted += after.n
        elif after is not None:  # cut short before it: dropped with the scratch sequence
            self.holes += after.n
        if parked:
            ctx.seq_rm(st.scratch, -1, -1)
        return placed

    def _park(self, st: SeqState, runs: Sequence[Run], cut: int, beyond: int) -> None:
        """Park ``runs`` of ``st`` on the scratch sequence, already at their new positions,
        and drop ``st``'s KV from ``cut`` on. ``beyond``: past every position in play."""
        ctx, scratch, seq = self.ctx, st.scratch, st.seq
        if runs:
            ctx.seq_rm(scratch, -1, -1)
            for r in runs:
                ctx.seq_cp(seq, scratch, r.src, r.src + r.n)
            # the runs stay in their old cells, amid those the dropped content leaves
            self.holes += max(0, len(st.tokens) - cut - sum(r.n for r in runs))
        ctx.seq_rm(seq, cut, -1)
        if runs:
            # two-step shift so a run's destination never overlaps a run not yet moved
            ctx.seq_add(scratch, 0, -1, beyond)
            for r in runs:
                ctx.seq_add(scratch, r.src + beyond, r.src + r.n + beyond, r.dst - r.src - beyond)

    def _unpark(self, st: SeqState, p0: int, p1: int) -> None:
        """Attach the parked KV at positions [p0, p1) to ``st`` (it is in place already)."""
        self.ctx.seq_cp(st.scratch, st.seq, p0, p1)
        self.ctx.seq_rm(st.scratch, p0, p1)

    def _unblock(self, st: SeqState) -> None:
        """Before a prompt without blocks: keep only the first block (at position 0 it is
        what a causal evaluation computes too)."""
        first = st.spans[0][1]
        st.spans = []
        self.truncate(st, min(len(st.tokens), first))
        st.exact = min(st.exact, len(st.tokens))

    def affordable(self, n_tokens: int, budget_ms: float) -> bool:
        """Whether evaluating ``n_tokens`` more fits ``budget_ms`` at the measured price
        (nothing is affordable before a price is measured, except nothing)."""
        if n_tokens <= 0:
            return True
        return self.ms_per_token > 0 and n_tokens * self.ms_per_token <= budget_ms

    def _compact_if_due(self, n_tokens: int) -> None:
        """Compact before evaluating ``n_tokens`` when the holes would cost them more than the
        copy (flash attention on: masked cells cost nothing, never). A pending KV shift
        defers it past the next decode: the caller asks again before each piece."""
        due = self.holes * n_tokens >= self.compact_min_work
        if due and not self.ctx.flash_attn:
            self._compact()

    def _evaluated(self, n_tokens: int, ms: float | None, pieces: Pieces) -> None:
        """After a prefill piece: its tokens went into the lowest free cells first, and its
        time (when it ran alone) prices the prompt's tokens and sizes the next piece."""
        self.holes = max(0, self.holes - n_tokens)
        if ms is not None:
            self._observe_price(n_tokens, ms)
        pieces.ran(n_tokens, ms)

    def _observe_price(self, n_tokens: int, ms: float) -> None:
        if n_tokens < PRICE_MIN_PIECE:
            return
        price = ms / n_tokens
        old = self.ms_per_token
        self.ms_per_token = price if old < 0 else 0.8 * old + 0.2 * price

    def _compact(self) -> bool:
        try:
            done = self.ctx.compact()
            if done:
                self.holes = 0
        except DecodeError:
            for st in (*self.slots, *self.aux):  # the restore failed: the KV buffer is empty
                st.tokens = []
                st.exact = 0
                st.spans = []
                st.reset_drift()
            raise
        self.n_compacted += done
        return done

    def appended(self, st: SeqState, tokens: Sequence[int]) -> int:
        """Record ``tokens`` decoded after the sequence's content (the caller put them in a
        batch); returns their first position."""
        toks = st.tokens
        pos = len(toks)
        self.holes = max(0, self.holes - len(tokens))
        toks.extend(tokens)
        if st.exact == pos:
            st.exact = len(toks)
        return pos

    def append(self, st: SeqState, tokens: Sequence[int], *, logits: str | Sequence[int]) -> int:
        """Decode ``tokens`` after the sequence's content; returns their first position."""
        self.ctx.decode(tokens, len(st.tokens), st.seq, logits=logits)
        return self.appended(st, tokens)

    def truncate(self, st: SeqState, n_keep: int) -> None:
        """Drop KV from position ``n_keep`` on (rejected draft tokens, a cancelled tail)."""
        if n_keep < len(st.tokens):
            self.ctx.seq_rm(st.seq, n_keep, -1)
            del st.tokens[n_keep:]
            st.exact = min(st.exact, n_keep)

    def clear(self, st: SeqState) -> None:
        self.ctx.seq_rm(st.seq, -1, -1)
        st.tokens = []
        st.spans = []
        st.exact = 0
        st.reset_drift()

    def share_prefix(self, src: SeqState, dst: SeqState, n: int) -> None:
        """Make ``dst`` hold ``src``'s first ``n`` tokens: their cells are re-tagged to both
        (an extra completion starts from the prompt's KV without evaluating it again)."""
        self.clear(dst)
        self.ctx.seq_cp(src.seq, dst.seq, 0, n)
        dst.tokens = list(src.tokens[:n])
        dst.exact = min(src.exact, n)

    def release(self, st: SeqState, shared: int) -> None:
        """Free an extra completion's sequence; the cells only it held become holes."""
        self.holes += max(0, len(st.tokens) - shared)
        self.clear(st)


def _worth_finishing(runs: dict[int, Run], pos: int, n_prompt: int) -> bool:
    """After a cancel: are the parked runs from ``pos`` on worth more than the gaps before them?

    Parked KV is dropped when the prefill stops, and the next keystroke (which has the same
    runs in its prompt) would recompute it; evaluating the fresh gaps up to the last run is
    cheaper whenever those runs hold more tokens than the gaps."""
    ahead = [r for d, r in runs.items() if d > pos]
    if not ahead:
        return False
    last_end = max(r.dst + r.n for r in ahead)
    moved = sum(r.n for r in ahead)
    return last_end - pos - moved < moved

"""Which cached KV a new prompt can keep, and which slot keeps the most: pure planning over token
lists.

A slot's cache holds ``cached`` (tokens with KV at positions 0..n-1). For a new ``prompt`` the
plan keeps the longest common prefix in place, then (chunk reuse, like llama-server's
``--cache-reuse N``) moves later runs of the cache that reappear in the prompt to their new
positions by a KV shift instead of recomputing them. Two differences from llama-server:

* runs may be separated by NEW prompt tokens (an edit in the middle), not only by deleted
  cache tokens; llama-server stops reusing at the first inserted token;
* a run that ends the prompt (the FIM suffix block behind the cursor) needs only
  ``tail_min`` tokens, not ``min_chunk``: the editor changes the middle of the FIM layout on
  every keystroke, and that block (~255 tokens with n_batch 1024) is just under llama-server's
  256 threshold, so llama-server re-evaluates it every time;
* so does a run that ends the *cache*: the start of a suffix block whose evaluation was cut
  short by an aborted keystroke. The next keystroke keeps it and evaluates only the rest, so
  a block longer than the time between two keys still gets built across them.

The last prompt token is always evaluated fresh (its logits start the generation).
Moved KV was computed under a slightly different left context: an approximation whose cost
the benchmark measures; ``min_chunk = 0`` turns all of it off (prefix reuse only: exact).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

ANCHOR = 4  # tokens hashed to find candidate runs; shorter runs are never worth a shift
MAX_CANDIDATES = 32  # cache positions tried per prompt position (bounds repetitive input)


@dataclass(frozen=True)
class Run:
    """Cache tokens [src, src + n) move to prompt positions [dst, dst + n)."""

    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class ReusePlan:
    n_prefix: int  # prompt[:n_prefix] is kept in place
    runs: tuple[Run, ...] = ()  # ordered by dst (and by src: runs never cross)
    n_prompt: int = 0
    fresh: tuple[tuple[int, int], ...] = field(default=())  # [start, end) prompt spans to evaluate

    @property
    def n_reused(self) -> int:
        return self.n_prefix + sum(r.n for r in self.runs)

    @property
    def n_evaluated(self) -> int:
        return self.n_prompt - self.n_reused


_STEP = 256


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix; compares slices in C, then narrows down."""
    n = min(len(a), len(b))
    i = 0
    while i + _STEP <= n and a[i : i + _STEP] == b[i : i + _STEP]:
        i += _STEP
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CachedSlot(Protocol):
    """What slot choice reads of a slot (the server's record of it)."""

    @property
    def id(self) -> int: ...
    @property
    def tokens(self) -> Sequence[int]: ...  # the slot's cached tokens after its last request
    @property
    def pieces(self) -> frozenset[int]: ...  # ``cache_pieces(tokens)``
    @property
    def last_used(self) -> float: ...  # monotonic time of its last request; 0 = never
    @property
    def is_processing(self) -> bool: ...
    @property
    def running(self) -> Sequence[int]: ...  # the prompt of the request running there, if any
    @property
    def running_pieces(self) -> frozenset[int]: ...  # ``cache_pieces(running)``
    @property
    def running_warm_up(self) -> bool: ...  # what runs there is a warm-up (a completion stops it)


PIECE = 16  # tokens per piece compared when choosing a slot
FIT_MIN = 64  # tokens: a cache that holds fewer of a long prompt shares a header, not context
PIN_HINT = 256  # tokens a pinned slot that fits at all is worth: clients that each pin their
# own slot stay there while another slot holds only a little more of a prompt
FIT_WAIT = 256  # a busy slot sharing a prefix this much longer than the best idle fit: wait


def cache_pieces(tokens: Sequence[int]) -> frozenset[int]:
    """Hashes of every ``PIECE``-token window of a slot's cache, built once per request it
    ran, so that choosing a slot for a prompt costs a set lookup per piece of the prompt."""
    return frozenset(hash(tuple(tokens[i : i + PIECE])) for i in range(len(tokens) - PIECE + 1))


def cache_fit(prompt: Sequence[int], pieces: frozenset[int]) -> int:
    """About how many of ``prompt``'s tokens a cache holds, in place or movable: its pieces
    found anywhere in the cache."""
    starts = range(0, len(prompt) - PIECE + 1, PIECE)
    return PIECE * sum(hash(tuple(prompt[i : i + PIECE])) in pieces for i in starts)


def pinned_slot(id_slot: int, n_slots: int) -> int | None:
    """llama-server's rule: a non-negative id wraps around the slot count; -1 means any."""
    return None if id_slot < 0 else id_slot % n_slots


@dataclass(frozen=True)
class SlotChoice:
    slot: int
    wait: bool = False  # the slot runs another request: queue for it


def choose_slot(
    prompt: Sequence[int],
    slots: Sequence[CachedSlot],
    id_slot: int = -1,
    *,
    follow_pin: bool = True,
    patient: bool = False,
) -> SlotChoice:
    """The slot a prompt runs on: the pinned one when pins are followed (llama-server's rule);
    else the one whose cache holds most of it, the pinned id a hint worth ``PIN_HINT`` tokens.

    Why pins can be hints: llama-vscode and llama.vim both send ``id_slot: 0``, so two editors
    on one daemon would take turns evicting each other's context from slot 0 while the other
    slots sit empty. Each editor's prompts open with its own ring of project code, so the cache
    that holds most of a prompt is that editor's. A prompt that fits no cache takes an unused
    slot, else the least recently used. A busy slot whose cache shares a prefix ``FIT_WAIT``
    tokens longer than every idle slot holds (the same editor's previous keystroke, about to be
    cancelled, or its warm-up still filling a slot) is waited for rather than evaluating the
    prompt again elsewhere. A busy slot's prefix counts the prompt running there: it holds
    that once the running request ends or is stopped (a first warm-up fills an empty slot);
    where a completion runs, only that counts (its prompt replaces the cache).
    A ``patient`` request (a warm-up: nobody waits for its answer) also waits for a busy slot
    that holds its pieces anywhere: a ring that moved on by a chunk shares no prefix with the
    editor's slot, and taking the idle slot would evict the other editor's context.
    """
    pinned = pinned_slot(id_slot, len(slots))
    if len(slots) == 1 or (follow_pin and pinned is not None):
        slot = slots[pinned or 0]
        return SlotChoice(slot.id, wait=slot.is_processing)
    least = min(FIT_MIN, len(prompt) // 2)  # what a shared header never reaches
    fit, kept = {}, {}  # among equal fits, the longest prefix: kept in place, its KV exact
    for s in slots:
        if s.is_processing and s.running and not s.running_warm_up:
            # a completion runs there: once it ends the slot holds its prompt, not the cache
            # it held before (another editor's request on the slot that held ours, or a
            # benchmark's clients on any slot: waiting would buy nothing)
            prefix, pieces = common_prefix(prompt, s.running), s.running_pieces
        else:
            prefix, pieces = common_prefix(prompt, s.tokens), s.pieces
            if s.is_processing:  # a warm-up, stopped by a completion: what it has done stays
                prefix = max(prefix, common_prefix(prompt, s.running))
        found = max(cache_fit(prompt, pieces), prefix)
        fit[s.id], kept[s.id] = (found, prefix) if found >= max(1, least) else (0, 0)

    def rank(s: CachedSlot) -> tuple[int, int, bool, float, bool]:
        hint = PIN_HINT if s.id == pinned and fit[s.id] else 0
        return fit[s.id] + hint, kept[s.id], not s.tokens, -s.last_used, s.id == pinned

    idle = [s for s in slots if not s.is_processing]
    if not idle:
        return SlotChoice(max(slots, key=rank).id, wait=True)
    best_idle = max(idle, key=rank)
    busy = [s for s in slots if s.is_processing]
    if busy:  # the prefix, not the pieces: a teammate's ring of the same code is no reason
        holds = fit if patient else kept  # (to make a completion wait)
        held = max(busy, key=lambda s: holds[s.id])
        if holds[held.id] - fit[best_idle.id] >= FIT_WAIT:
            return SlotChoice(held.id, wait=True)
    return SlotChoice(best_idle.id)


def _fresh_spans(n_prefix: int, runs: Sequence[Run], n_prompt: int) -> tuple[tuple[int, int], ...]:
    spans: list[tuple[int, int]] = []
    head = n_prefix
    for run in runs:
        if run.dst > head:
            spans.append((head, run.dst))
        head = run.dst + run.n
    if head < n_prompt:
        spans.append((head, n_prompt))
    return tuple(spans)


def plan_reuse(
    cached: Sequence[int],
    prompt: Sequence[int],
    *,
    min_chunk: int = 256,
    tail_min: int = 32,
    tail_refresh: int = 0,
    can_shift: bool = True,
) -> ReusePlan:
    """Plan the reuse of ``cached`` KV for ``prompt`` (see the module docstring)."""
    n_prompt = len(prompt)
    n_prefix = common_prefix(cached, prompt)
    if n_prefix >= n_prompt:
        n_prefix = max(0, n_prompt - 1)  # the last token is re-evaluated for its logits
    runs: list[Run] = []
    if min_chunk > 0 and can_shift and n_prompt - n_prefix > ANCHOR:
        runs = _find_runs(cached, prompt, n_prefix, min_chunk, max(ANCHOR, tail_min))
        last = runs[-1] if runs else None
        ends_prompt = last is not None and last.dst + last.n == n_prompt - 1
        if tail_refresh > 0 and last is not None and last.n < min_chunk and ends_prompt:
            # re-evaluate the first tokens of a short tail run (nearest the edit) fresh; not
            # while the block is still being built (a run that ends the cache only): typing
            # faster than the block evaluates would redo the refresh on every key and never
            # finish the block
            runs.pop()
            if last.n - tail_refresh >= max(ANCHOR, tail_min):
                runs.append(
                    Run(last.src + tail_refresh, last.dst + tail_refresh, last.n - tail_refresh)
                )
    return ReusePlan(n_prefix, tuple(runs), n_prompt, _fresh_spans(n_prefix, runs, n_prompt))


def refresh_window(plan: ReusePlan, offset: int, width: int) -> ReusePlan:
    """Re-evaluate ``width`` tokens of the plan's last run from ``offset`` on; keep the rest.

    A rolling refresh of a moved suffix block: one window per keystroke, so every token of the
    block is recomputed once every few keys and none grows stale, without the latency spike of
    recomputing the whole block at once (which tends to land on the keystroke that matters)."""
    if not plan.runs:
        return plan
    *runs, last = plan.runs
    offset = max(0, min(offset, last.n))
    width = min(width, last.n - offset)
    if width <= 0:
        return plan
    if offset > 0:
        runs.append(Run(last.src, last.dst, offset))
    skip = offset + width
    if skip < last.n:
        runs.append(Run(last.src + skip, last.dst + skip, last.n - skip))
    fresh = _fresh_spans(plan.n_prefix, runs, plan.n_prompt)
    return ReusePlan(plan.n_prefix, tuple(runs), plan.n_prompt, fresh)


def _find_runs(
    cached: Sequence[int], prompt: Sequence[int], start: int, min_chunk: int, tail_min: int
) -> list[Run]:
    n_cache, n_prompt = len(cached), len(prompt)
    end = n_prompt - 1  # the last prompt token never comes from the cache
    index: dict[tuple[int, ...], list[int]] = {}
    for c in range(start, n_cache - ANCHOR + 1):
        index.setdefault(tuple(cached[c : c + ANCHOR]), []).append(c)
    runs: list[Run] = []
    head_c = start  # runs are monotone: the next one starts at or after this cache index
    p = start
    while p + ANCHOR <= end:
        best_c, best_n = -1, 0
        cands = index.get(tuple(prompt[p : p + ANCHOR]), [])
        first = bisect_left(cands, head_c)
        for c in cands[first : first + MAX_CANDIDATES]:
            n = ANCHOR
            while c + n < n_cache and p + n < end and cached[c + n] == prompt[p + n]:
                n += 1
            if n > best_n:
                best_c, best_n = c, n
        ends_block = p + best_n == end or best_c + best_n == n_cache
        if best_n >= min_chunk or (ends_block and best_n >= tail_min):
            runs.append(Run(best_c, p, best_n))
            head_c = best_c + best_n
            p += best_n
        else:
            p += 1
    return runs

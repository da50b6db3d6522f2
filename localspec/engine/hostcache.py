"""Slot contexts kept in host memory, so a context a new prompt overwrites comes back cheaply.

One slot serves several editors (two VS Code windows, VS Code and Vim) or files in turn: each
switch would evaluate the other context again. Before a request overwrites a slot's context,
``recall`` copies that context (target and draft KV, engine/slotstate.py) into a RAM cache
bounded by ``max_bytes``; a request whose prompt a cached context serves better than the
slot's own restores it instead of evaluating, when the copy costs less than the evaluation it
saves, at the copy price and the prefill price measured on this machine. Entries are keyed by
their tokens (the longest reuse wins) and evicted least recently used. A restored context is
bit for bit the evaluated one, so answers are what they were (exactness).

Only the engine's thread calls it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from localspec.engine.cache import SeqState, block_spans
from localspec.engine.cache_plan import cache_fit, cache_pieces
from localspec.engine.pair import ModelPair
from localspec.engine.slot import Slot
from localspec.engine.slotstate import SlotSnapshot, StateError, put, take
from localspec.engine.types import PromptLayout

# a context is worth keeping once a new prompt would drop this many of its tokens: a few
# changed tokens at the end (a keystroke) are cheaper to evaluate again than to copy
MIN_DROPPED = 256
MIN_GAIN = 64  # a restore must save at least this many evaluated tokens
# the copy's price before any is measured (ms per MiB of state; bench/restore.py measures it
# on this machine, well below this); the estimate then follows the measured copies
COPY_MS_PER_MIB = 1.0
EMA = 0.3
PLANNED = 2  # cached contexts whose reuse is planned exactly, the best by their pieces found


@dataclass
class Entry:
    tokens: list[int]
    snap: SlotSnapshot
    # its pieces' hashes (cache_plan.cache_pieces): a set lookup per piece of a prompt bounds
    # what it could serve, so only the likeliest entries get a reuse plan
    pieces: frozenset[int] = field(default_factory=frozenset)

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in self.snap.target.meta.get("spans", [])]

    @property
    def sink(self) -> bool:
        return bool(self.snap.target.meta.get("sink", False))

    @property
    def n_bytes(self) -> int:
        return self.snap.n_bytes


@dataclass
class Recall:
    """What ``recall`` did before a request: the context it stashed, the one it restored."""

    stashed: int = 0  # tokens of the slot's context copied to the cache
    restored: int = 0  # tokens of a cached context put back into the slot
    gained: int = 0  # prompt tokens that restore saved evaluating
    restore_ms: float = 0.0
    stash_ms: float = 0.0


class HostCache:
    """An LRU of slot contexts, at most ``max_bytes`` of host memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self.n_bytes = 0
        self.hits = 0  # restores
        self.misses = 0  # prompts no entry served better than the slot
        self.restored_tokens = 0
        self.restore_ms = 0.0
        self.stashed = 0
        self.evicted = 0
        self.ms_per_mib = COPY_MS_PER_MIB

    def __len__(self) -> int:
        return len(self.entries)

    def stash(self, snap: SlotSnapshot) -> bool:
        """Keep ``snap``; entries it contains (their tokens a prefix of its) go. False when it
        cannot fit at all."""
        tokens = snap.tokens
        if not tokens or snap.n_bytes > self.max_bytes:
            return False
        for key, e in list(self.entries.items()):
            if len(e.tokens) <= len(tokens) and tokens[: len(e.tokens)] == e.tokens:
                self._drop(key)
        while self.entries and self.n_bytes + snap.n_bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))
            self.evicted += 1
        self.entries[self._next] = Entry(tokens, snap, cache_pieces(tokens))
        self._next += 1
        self.n_bytes += snap.n_bytes
        self.stashed += 1
        return True

    def holds(self, tokens: list[int]) -> bool:
        """An entry holds ``tokens`` (or more after them): stashing them again gains nothing."""
        n = len(tokens)
        return any(len(e.tokens) >= n and e.tokens[:n] == tokens for e in self.entries.values())

    def _drop(self, key: int) -> None:
        self.n_bytes -= self.entries.pop(key).n_bytes

    def copy_ms(self, n_bytes: int) -> float:
        return n_bytes / (1 << 20) * self.ms_per_mib

    def observe_copy(self, n_bytes: int, ms: float) -> None:
        if n_bytes >= 1 << 16:  # tiny copies measure the call, not the copy
            per = ms / (n_bytes / (1 << 20))
            self.ms_per_mib += EMA * (per - self.ms_per_mib)


def usable(n_reused: int, spans: list[tuple[int, int]], sink: bool, layout: PromptLayout) -> int:
    """Of ``n_reused`` tokens a reuse plan keeps of a cache built with ``spans`` (ring blocks;
    [] causal), those the prompt's evaluation keeps: blocks built another way than the
    prompt's are evaluated again past the first (cache.SlotCaches._blocks_first)."""
    want = block_spans(layout.blocks)
    if not want:
        return min(n_reused, spans[0][1]) if spans else n_reused
    if not spans or sink != layout.block_sink:
        return min(n_reused, want[0][1])
    return n_reused


def recall(
    pair: ModelPair, cache: HostCache, slot: Slot, layout: PromptLayout, *, restore: bool = True
) -> Recall:
    """Before ``layout`` runs on the idle ``slot``: stash the slot's context when the prompt
    would drop much of it, and (``restore``) restore the cached context that serves the prompt
    best when that saves more evaluation than its copy costs."""
    done = Recall()
    tc = pair.tcache
    policy = pair.prefill_policy(True)
    st = tc.slots[slot.id]
    prompt = layout.tokens
    held = list(st.tokens)
    keep = 0  # without ``restore`` the prompt is evaluated afresh: the slot drops it all
    if held and restore:
        keep = usable(tc.plan(st, prompt, policy).n_reused, st.spans, st.sink, layout)
    best: Entry | None = None
    best_key, best_keep = -1, keep
    if restore and len(prompt) - keep >= MIN_GAIN and cache.entries:  # (a keystroke: no gain)
        fits = sorted(
            ((cache_fit(prompt, e.pieces), key) for key, e in cache.entries.items()), reverse=True
        )
        for fit, key in fits[:PLANNED]:
            if fit < keep + MIN_GAIN:
                break
            e = cache.entries[key]
            n = tc.plan(SeqState(-1, tokens=e.tokens), prompt, policy).n_reused
            n = usable(n, e.spans, e.sink, layout)
            if n > best_keep:
                best, best_key, best_keep = e, key, n
    gain = best_keep - keep
    price = tc.ms_per_token  # the measured prefill price; -1 before any prefill ran
    worth = (
        best is not None
        and gain >= MIN_GAIN
        and (price < 0 or cache.copy_ms(best.n_bytes) < gain * price)
    )
    if len(held) - keep >= MIN_DROPPED and not cache.holds(held):
        t0 = time.perf_counter()
        snap = take(pair, slot.id)
        done.stash_ms = (time.perf_counter() - t0) * 1e3
        cache.observe_copy(snap.n_bytes, done.stash_ms)
        if cache.stash(snap):
            done.stashed = len(held)
    if not worth or best is None:
        if gain < MIN_GAIN:
            cache.misses += 1
        return done
    if best_key in cache.entries:  # (a stash just now may have evicted it: it restores still)
        cache.entries.move_to_end(best_key)
    t0 = time.perf_counter()
    try:
        put(pair, slot.id, best.snap)
    except StateError:
        slot.hold(slot.cached())
        return done
    done.restore_ms = (time.perf_counter() - t0) * 1e3
    cache.observe_copy(best.n_bytes, done.restore_ms)
    slot.hold(slot.cached())
    done.restored, done.gained = len(best.tokens), gain
    cache.hits += 1
    cache.restored_tokens += len(best.tokens)
    cache.restore_ms += done.restore_ms
    return done

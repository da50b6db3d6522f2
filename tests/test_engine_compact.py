"""KV buffer compaction: moved runs leave holes that flash-attention-off decoding pays for.

Compaction is a whole-state save and restore; these tests check that it changes no logit, that
it waits for a pending KV shift (a save would store K without its rotation), when a prefill
asks for it, and that a failed restore empties the cache instead of leaving it wrong.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np
import pytest

from localspec.engine import llama as llama_mod
from localspec.engine.cache import COMPACT_MIN_WORK, COMPACT_OFF, PrefillPolicy, SlotCaches
from localspec.engine.errors import DecodeError
from localspec.engine.llama import Clock, Context, Model
from tests import kv_support
from tests.kv_support import N_CTX, ms, new_ctx

model = kv_support.model_fixture()
toks = kv_support.tokens_fixture(1000)


def fill(ctx: Context, tokens: list[int], pos0: int, seq: int) -> np.ndarray:
    for i in range(0, len(tokens), 100):
        ctx.decode(tokens[i : i + 100], pos0 + i, seq, logits="last")
    return np.array(ctx.logits(-1))


def moved_run(ctx: Context, toks: list[int]) -> None:
    """800 tokens in seq 0, then [400, 700) moved to position 0 of seq 1 (shift pending)."""
    fill(ctx, toks[:800], 0, 0)
    ctx.seq_cp(0, 1, 400, 700)
    ctx.seq_rm(0, -1, -1)
    ctx.seq_add(1, 400, 700, -400)


def test_compact_changes_no_logit_and_waits_for_a_pending_shift(
    model: Model, toks: list[int]
) -> None:
    a, ref = new_ctx(model), new_ctx(model)
    try:
        for ctx in (a, ref):
            moved_run(ctx, toks)
        assert a.shift_pending
        assert not a.compact()  # refused: the moved K is rotated by the next decode
        for ctx in (a, ref):
            ctx.decode(toks[800:801], 300, 1, logits="last")
        assert not a.shift_pending
        assert a.compact()
        warm, want = fill(a, toks[801:1000], 301, 1), fill(ref, toks[801:1000], 301, 1)
        np.testing.assert_allclose(warm, want, rtol=0, atol=1e-4)
        assert int(np.argmax(warm)) == int(np.argmax(want))
    finally:
        a.close()
        ref.close()


def test_a_state_round_trip_with_a_shift_pending_would_lose_the_rotation(
    model: Model, toks: list[int]
) -> None:
    """Why ``compact`` refuses while a shift is pending (llama.cpp applies seq_add's rotation
    to K at the next decode, and a saved state carries the new positions without it)."""
    a, ref = new_ctx(model), new_ctx(model)
    try:
        for ctx in (a, ref):
            moved_run(ctx, toks)
        size = int(llama_mod.C.llama_state_get_size(a.handle))
        buf = (ctypes.c_uint8 * size)()
        n = int(llama_mod.C.llama_state_get_data(a.handle, buf, size))
        assert int(llama_mod.C.llama_state_set_data(a.handle, buf, n)) == n
        lost, want = fill(a, toks[800:900], 300, 1), fill(ref, toks[800:900], 300, 1)
        assert np.max(np.abs(lost - want)) > 1e-2
    finally:
        a.close()
        ref.close()


def prompts(toks: list[int]) -> tuple[list[int], list[int]]:
    """A cached prompt and the next one: its middle run moved to the front, new text after."""
    return toks[:800], toks[900:902] + toks[400:700] + toks[700:800][::-1] + toks[800:900]


@pytest.mark.parametrize("flash_attn", [False, True])
def test_prefill_compacts_before_evaluating_around_moved_runs(
    model: Model, toks: list[int], flash_attn: bool
) -> None:
    first, second = prompts(toks)
    results = []
    for compact in (True, False):
        ctx = new_ctx(model, flash_attn=flash_attn)
        try:
            caches = SlotCaches(
                ctx, 1, compact_min_work=COMPACT_MIN_WORK if compact else COMPACT_OFF
            )
            caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=256))
            pre = caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=256, chunk=64))
            assert pre.n_shifted == 300 and pre.n_evaluated == len(second) - 300
            assert caches.slots[0].tokens == second
            # holes (800 - 300) x 202 evaluated tokens: due, unless flash attention is on
            want = 1 if compact and not flash_attn else 0
            assert caches.n_compacted == want
            results.append(np.array(ctx.logits(-1)))
            more = toks[950:990]
            results.append(fill(ctx, more, len(second), 0))
        finally:
            ctx.close()
    np.testing.assert_allclose(results[0], results[2], rtol=0, atol=1e-4)
    np.testing.assert_allclose(results[1], results[3], rtol=0, atol=1e-4)


def test_a_small_edit_does_not_compact(model: Model, toks: list[int]) -> None:
    ctx = new_ctx(model)
    try:
        caches = SlotCaches(ctx, 1)
        caches.prefill(caches.slots[0], toks[:800], PrefillPolicy(min_chunk=256))
        # 3 tokens deleted in front of a 300-token run: 3 holes, a few tokens to evaluate
        caches.prefill(caches.slots[0], toks[:397] + toks[400:800], PrefillPolicy(min_chunk=256))
        assert caches.n_compacted == 0
    finally:
        ctx.close()


def test_a_failed_restore_empties_every_slot_instead_of_leaving_it_wrong(
    model: Model, toks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = prompts(toks)
    ctx = new_ctx(model)
    try:
        caches = SlotCaches(ctx, 1)
        caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=256))
        monkeypatch.setattr(llama_mod.C, "llama_state_set_data", lambda *a: 0)
        with pytest.raises(DecodeError, match="compacting"):
            caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=256))
        assert caches.slots[0].tokens == []
        assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_max(1) == -1
        monkeypatch.undo()
        caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=256))
        assert caches.slots[0].tokens == second
        got = np.array(ctx.logits(-1))
        cold = new_ctx(model)
        try:
            want = fill(cold, second, 0, 0)
        finally:
            cold.close()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    finally:
        ctx.close()


def test_compact_refuses_a_state_larger_than_its_cap(model: Model, toks: list[int]) -> None:
    ctx = new_ctx(model)
    try:
        fill(ctx, toks[:100], 0, 0)
        assert not ctx.compact(max_bytes=1024)
        assert ctx.compact()
        assert ctx.seq_pos_max(0) == 99
    finally:
        ctx.close()


def test_compacting_for_one_slot_keeps_the_other_slots_kv(model: Model, toks: list[int]) -> None:
    """The save and restore is of the whole context: every slot's cells move."""
    settings = ms(Path(model.path))
    ctx = Context(model, settings, n_seq=3, n_ctx_total=2 * N_CTX, clock=Clock())
    try:
        caches = SlotCaches(ctx, 2)
        other = toks[100:400]
        caches.prefill(caches.slots[1], other, PrefillPolicy())
        first, second = prompts(toks)
        caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=256))
        caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=256))
        assert caches.n_compacted == 1
        more = toks[950:990]
        got = [fill(ctx, more, len(second), 0), fill(ctx, more, len(other), 1)]
        assert caches.slots[1].tokens == other
    finally:
        ctx.close()
    ref = Context(model, settings, n_seq=3, n_ctx_total=2 * N_CTX, clock=Clock())
    try:
        ref_caches = SlotCaches(ref, 2, compact_min_work=COMPACT_OFF)
        ref_caches.prefill(ref_caches.slots[1], other, PrefillPolicy())
        ref_caches.prefill(ref_caches.slots[0], first, PrefillPolicy(min_chunk=256))
        ref_caches.prefill(ref_caches.slots[0], second, PrefillPolicy(min_chunk=256))
        want = [fill(ref, more, len(second), 0), fill(ref, more, len(other), 1)]
    finally:
        ref.close()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4)


def test_holes_a_ring_rotation_leaves_are_compacted_by_the_request_that_evaluates_next(
    model: Model, toks: list[int]
) -> None:
    """An editor's ring warm-up moves the blocks and is cut short by the next keystroke; the
    keystroke's prefill has nothing to move, yet evaluates every new token above the holes the
    warm-up left. The hole count outlives the request that made the holes."""
    tail = toks[400:500]
    first, second = toks[:300] + tail, toks[60:360] + tail  # the ring: 60-token chunks
    blocks = (60,) * 5
    results = []
    for min_work in (10_000, COMPACT_OFF):
        ctx = new_ctx(model, n_seq=3)
        try:
            caches = SlotCaches(ctx, 1, compact_min_work=min_work)
            caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64), blocks=blocks)
            warm = caches.prefill(
                caches.slots[0],
                second,
                PrefillPolicy(min_chunk=64),
                blocks=blocks,
                cancel=threading_set(),
            )
            assert warm.cancelled and warm.n_shifted == 4 * 60 and caches.n_compacted == 0
            assert caches.holes == len(first) - 4 * 60  # the old first block and the tail
            key = caches.prefill(
                caches.slots[0], second, PrefillPolicy(min_chunk=64, chunk=40), blocks=blocks
            )
            assert key.n_shifted == 0 and key.n_evaluated == 60 + len(tail)
            # 160 holes x 160 tokens to evaluate: due at 10k (the ring's new block is the first)
            assert caches.n_compacted == (1 if min_work == 10_000 else 0)
            assert caches.holes == 0
            results.append(np.array(ctx.logits(-1)))
        finally:
            ctx.close()
    np.testing.assert_allclose(results[0], results[1], rtol=0, atol=1e-3)


def threading_set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event

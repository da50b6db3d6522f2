"""Ring blocks: leading spans of a prompt evaluated each on its own, so moving one is exact.

An editor's ring loses its oldest chunk at the front and the rest moves up. Evaluated causally,
every moved chunk attended to the chunk that left: a KV shift keeps approximate KV, and exact
KV means re-evaluating the whole ring. As blocks, a chunk's KV depends on its own tokens only:
moved by a KV shift, it equals a cold evaluation of the same layout (up to the rounding of K's
rotation), and only the new chunk and what follows the blocks are evaluated.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from localspec.engine.cache import PrefillPolicy, SlotCaches, block_spans
from localspec.engine.llama import Model
from localspec.engine.types import Cancel
from tests import kv_support
from tests.kv_support import new_ctx

ATOL = 1e-3  # batch splits round differently (test_engine_exact_kv)
# a moved block's K is rotated and rounded to F16 again: measured 1.6e-3 after one move and
# 2.4e-3 / 2.6e-3 after two (AVX-512 / AVX2-only builds). A block whose KV is wrong is far
# off: a causal ring moved by a shift is 1.0 away, a tail one position late 1.6.
ROTATION_ATOL = 5e-3
CHUNK = 60

model = kv_support.model_fixture()
toks = kv_support.tokens_fixture(600)


@pytest.fixture
def caches(model: Model) -> Iterator[SlotCaches]:
    ctx = new_ctx(model, n_seq=3)
    yield SlotCaches(ctx, 1)
    ctx.close()


def chunks(toks: list[int], n: int) -> list[list[int]]:
    return [toks[i * CHUNK : (i + 1) * CHUNK] for i in range(n)]


def layout(ring: list[list[int]], tail: list[int]) -> tuple[list[int], tuple[int, ...]]:
    return [t for c in ring for t in c] + tail, tuple(len(c) for c in ring)


class After:
    """Cancels once ``n`` block pieces have been decoded."""

    def __init__(self, n: int) -> None:
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


def cold_logits(
    model: Model, prompt: list[int], blocks: tuple[int, ...], sink: bool = False
) -> np.ndarray:
    ctx = new_ctx(model, n_seq=3)
    try:
        caches = SlotCaches(ctx, 1)
        caches.prefill(caches.slots[0], prompt, PrefillPolicy(), blocks=blocks, sink=sink)
        return np.array(ctx.logits(-1))
    finally:
        ctx.close()


def logits(caches: SlotCaches) -> np.ndarray:
    return np.array(caches.ctx.logits(-1))


def test_a_rotated_ring_of_blocks_is_moved_and_stays_exact(
    model: Model, caches: SlotCaches, toks: list[int]
) -> None:
    c = chunks(toks, 6)
    tail = toks[500:560]
    first, blocks = layout(c[0:5], tail)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64), blocks=blocks)
    second, blocks2 = layout(c[1:6], tail)  # the oldest chunk leaves, a new one arrives
    pre = caches.prefill(
        caches.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=0.0), blocks=blocks2
    )
    # four chunks moved, the new chunk and the tail evaluated (the tail attends to all)
    assert pre.n_shifted == 4 * CHUNK and pre.n_evaluated == CHUNK + len(tail)
    assert caches.slots[0].exact == len(second) == pre.n_exact
    assert caches.slots[0].spans == block_spans(blocks2)
    warm = logits(caches)
    # only K's rotation rounds differently
    moved_error = np.max(np.abs(warm - cold_logits(model, second, blocks2)))
    assert moved_error < ROTATION_ATOL
    # the same rotation evaluated causally, with a KV shift: hundreds of times further off
    causal = SlotCaches(new_ctx(model, n_seq=3), 1)
    causal.prefill(causal.slots[0], first, PrefillPolicy(min_chunk=64))
    shifted = causal.prefill(causal.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=0.0))
    assert shifted.n_shifted > 0
    cold_causal = cold_logits(model, second, ())
    assert np.max(np.abs(logits(causal) - cold_causal)) > 100 * moved_error
    # blocks are a different computation than causal attention over the ring
    assert np.max(np.abs(warm - cold_causal)) > 10 * ATOL
    causal.ctx.close()


@pytest.mark.parametrize("exact_ms", [0.0, 1e9])
def test_the_cursors_code_after_a_changed_ring_is_moved_unless_exact_kv_is_affordable(
    model: Model, toks: list[int], exact_ms: float
) -> None:
    """The ring turns under the cursor's code (a chunk evicted, one added): that code's KV
    moves by a KV shift, approximate (it attended to the old ring), as llama-server's
    ``--cache-reuse`` moves it, unless evaluating it again fits the exact-KV budget. Before,
    it was evaluated again whatever that cost: ~1 000 tokens after each ring change with
    llama.vim's 256 lines above the cursor."""
    c = chunks(toks, 6)
    tail = toks[400:600]  # the cursor's code: longer than min_chunk
    first, blocks = layout(c[0:5], tail)
    second, blocks2 = layout(c[1:6], tail)
    ctx = new_ctx(model, n_seq=3)
    try:
        caches = SlotCaches(ctx, 1)
        slot = caches.slots[0]
        caches.prefill(slot, first, PrefillPolicy(min_chunk=64), blocks=blocks)
        policy = PrefillPolicy(min_chunk=64, exact_ms=exact_ms)
        pre = caches.prefill(slot, second, policy, blocks=blocks2)
        assert slot.tokens == second and slot.spans == block_spans(blocks2)
        if exact_ms:  # affordable: evaluated again, exact
            assert pre.n_evaluated == CHUNK + len(tail) and slot.exact == len(second)
        else:  # moved: only the new chunk and the prompt's last token are evaluated
            assert pre.n_shifted == 4 * CHUNK + len(tail) - 1 and pre.n_evaluated == CHUNK + 1
            assert slot.exact == 5 * CHUNK  # the blocks; the moved code is approximate
            # the next keystroke reuses it all (no second move, nothing dropped)
            again = caches.prefill(slot, [*second, toks[10]], policy, blocks=blocks2)
            assert again.n_evaluated == 1 and again.n_shifted == 0
    finally:
        ctx.close()


def test_blocks_in_place_keep_the_cache_and_the_tail_reuses_its_prefix(
    caches: SlotCaches, toks: list[int]
) -> None:
    c = chunks(toks, 4)
    first, blocks = layout(c, toks[300:360])
    caches.prefill(caches.slots[0], first, PrefillPolicy(), blocks=blocks)
    assert caches.blocks_in_place(caches.slots[0], blocks) and not caches.blocks_in_place(
        caches.slots[0], blocks[:3]
    )
    longer, _ = layout(c, toks[300:365])  # a keystroke: the tail grows
    pre = caches.prefill(caches.slots[0], longer, PrefillPolicy(min_chunk=64), blocks=blocks)
    assert pre.n_evaluated == 5 and pre.n_cached == len(first) and pre.n_shifted == 0
    assert caches.slots[0].exact == len(longer)


def test_a_cut_short_block_resumes_and_a_prompt_without_blocks_keeps_only_the_first(
    model: Model, caches: SlotCaches, toks: list[int]
) -> None:
    c = chunks(toks, 3)
    prompt, blocks = layout(c, toks[300:340])
    cancel: Cancel = After(4)  # the first chunk and a third of the second
    pre = caches.prefill(
        caches.slots[0], prompt, PrefillPolicy(chunk=20), blocks=blocks, cancel=cancel
    )
    assert pre.cancelled and pre.n_evaluated == 80 and len(caches.slots[0].tokens) == 80
    pre = caches.prefill(
        caches.slots[0], prompt, PrefillPolicy(chunk=20), blocks=blocks
    )  # the second chunk's rest, on
    assert pre.n_evaluated == len(prompt) - 80 and not pre.cancelled
    np.testing.assert_allclose(logits(caches), cold_logits(model, prompt, blocks), atol=ATOL)
    pre = caches.prefill(
        caches.slots[0], prompt, PrefillPolicy()
    )  # causal now: only the first block is still right
    assert pre.n_cached == CHUNK and caches.slots[0].spans == []
    np.testing.assert_allclose(logits(caches), cold_logits(model, prompt, ()), atol=ATOL)


def test_a_cut_short_block_moves_with_the_ring_and_resumes(
    model: Model, caches: SlotCaches, toks: list[int]
) -> None:
    """An editor's ring warm-up is cut short inside its new chunk, and the ring turns again
    before the next request: the chunk's evaluated start moves with it, exactly."""
    c, tail = chunks(toks, 7), toks[500:540]
    first, blocks = layout([toks[:4], *c[1:5]], tail)  # a 4-token header, the sink
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64), blocks=blocks, sink=True)
    second, blocks2 = layout([toks[:4], *c[2:6]], tail)  # c1 leaves, c5 arrives
    cut = caches.prefill(
        caches.slots[0],
        second,
        PrefillPolicy(min_chunk=64, chunk=20),
        blocks=blocks2,
        sink=True,
        cancel=After(2),
    )  # 40 tokens of c5
    assert cut.cancelled and len(caches.slots[0].tokens) == 4 + 3 * CHUNK + 40
    third, blocks3 = layout([toks[:4], *c[3:7]], tail)  # c2 leaves, c6 arrives
    pre = caches.prefill(
        caches.slots[0], third, PrefillPolicy(min_chunk=64, chunk=20), blocks=blocks3, sink=True
    )
    # c3, c4 and c5's first 40 tokens moved; c5's last 20, c6 and the tail evaluated
    assert pre.n_shifted == 2 * CHUNK + 40
    assert pre.n_evaluated == 20 + CHUNK + len(tail)
    assert caches.slots[0].exact == len(third)
    # c3 and c4 turned twice: K's rotation rounds twice (as when c5 was whole)
    np.testing.assert_allclose(
        logits(caches), cold_logits(model, third, blocks3, sink=True), atol=ROTATION_ATOL
    )


def test_a_request_cut_short_before_its_new_block_decodes_nothing(
    caches: SlotCaches, toks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keystroke the editor already abandoned still reaches the engine; with the sink, a new
    block would first decode the header's copy (a whole pass over the weights for a few
    tokens) and throw it away."""
    c, tail = chunks(toks, 5), toks[500:540]
    first, blocks = layout([toks[:4], *c[0:3]], tail)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64), blocks=blocks, sink=True)
    second, blocks2 = layout([toks[:4], *c[1:4]], tail)
    decoded: list[int] = []
    real = caches.ctx.decode

    def decode(tokens: list[int], *args: object, **kw: object) -> None:
        decoded.append(len(tokens))
        real(tokens, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(caches.ctx, "decode", decode)
    pre = caches.prefill(
        caches.slots[0],
        second,
        PrefillPolicy(min_chunk=64),
        blocks=blocks2,
        sink=True,
        cancel=After(0),
    )
    assert pre.cancelled and pre.n_shifted == 2 * CHUNK and decoded == []


def test_without_kv_shifts_a_rotated_ring_is_evaluated_again(
    caches: SlotCaches, toks: list[int]
) -> None:
    c = chunks(toks, 4)
    first, blocks = layout(c[0:3], toks[300:340])
    caches.prefill(caches.slots[0], first, PrefillPolicy(), blocks=blocks)
    second, blocks2 = layout(c[1:4], toks[300:340])
    pre = caches.prefill(
        caches.slots[0], second, PrefillPolicy(), blocks=blocks2
    )  # min_chunk 0: --cache-reuse 0
    assert pre.n_shifted == 0 and pre.n_evaluated == len(second)


def test_blocks_that_see_a_sink_still_move_exactly(
    model: Model, caches: SlotCaches, toks: list[int]
) -> None:
    """With ``sink`` every block also attends to the first one (the repository header), placed
    right before it: a moved block is still what a cold evaluation computes."""
    header, c, tail = toks[:4], chunks(toks[4:], 5), toks[500:540]
    first, blocks = layout([header, *c[0:4]], tail)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64), blocks=blocks, sink=True)
    second, blocks2 = layout([header, *c[1:5]], tail)
    pre = caches.prefill(
        caches.slots[0], second, PrefillPolicy(min_chunk=64), blocks=blocks2, sink=True
    )
    assert pre.n_shifted == 3 * CHUNK and pre.n_evaluated == CHUNK + len(tail)
    assert caches.blocks_in_place(caches.slots[0], blocks2, True) and not caches.blocks_in_place(
        caches.slots[0], blocks2
    )
    warm = logits(caches)

    with_sink = cold_logits(model, second, blocks2, sink=True)
    moved_error = np.max(np.abs(warm - with_sink))  # K's rotation rounding, as without a sink
    assert moved_error < ROTATION_ATOL
    assert (
        np.max(np.abs(with_sink - cold_logits(model, second, blocks2))) > 10 * moved_error
    )  # the chunks saw it

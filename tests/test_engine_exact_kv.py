"""Exact KV when the machine can afford it: no KV shift, and earlier shifts repaid.

A moved run's KV was computed after other text, so answers drift from a cold evaluation's.
When keeping the KV exact (re-evaluating from the first approximate token) costs at most
``exact_ms`` more at the measured prefill price, the slot cache does that instead. These tests
check the choice, the bookkeeping of how much of a slot is exact, and the logits against a
cold context (the strict check: a shifted run changes them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from localspec.engine import Engine, EngineSettings, GenerationRequest, SpecSettings
from localspec.engine.cache import PrefillPolicy, SlotCaches
from localspec.engine.llama import Model
from tests import kv_support
from tests.kv_support import ms, new_ctx

ATOL = 1e-3  # batch splits round differently; a moved run changes logits far more (checked)
# a prefill price (ms per token) at which this file's whole context fits the default 100 ms
# budget, set where a test needs the budget to allow a repair whatever this CPU measures
CHEAP = 0.01


model = kv_support.model_fixture()
toks = kv_support.tokens_fixture(600)


@pytest.fixture
def caches(model: Model) -> Iterator[SlotCaches]:
    ctx = new_ctx(model)
    yield SlotCaches(ctx, 1)
    ctx.close()


def cold_logits(model: Model, prompt: list[int]) -> np.ndarray:
    ctx = new_ctx(model)
    try:
        for i in range(0, len(prompt), 100):
            end = min(len(prompt), i + 100)
            ctx.decode(prompt[i:end], i, 0, logits="last" if end == len(prompt) else "none")
        return np.array(ctx.logits(-1))
    finally:
        ctx.close()


def ring(toks: list[int]) -> tuple[list[int], list[int]]:
    """An editor's ring rotation: the oldest chunk leaves the front, the rest moves up."""
    old, kept, local = toks[:100], toks[100:400], toks[400:560]
    return old + kept + local, kept + local


def warm_logits(caches: SlotCaches) -> np.ndarray:
    return np.array(caches.ctx.logits(-1))


def test_a_shift_changes_the_logits_and_leaves_the_slot_approximate(
    model: Model, caches: SlotCaches, toks: list[int]
) -> None:
    first, second = ring(toks)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    assert caches.slots[0].exact == len(first) and caches.ms_per_token > 0
    pre = caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=0.0))
    assert pre.n_shifted == len(second) - 1 and pre.n_exact == 0 == caches.slots[0].exact
    assert np.max(np.abs(warm_logits(caches) - cold_logits(model, second))) > 10 * ATOL


def test_an_affordable_shift_is_replaced_by_an_exact_evaluation(
    model: Model, caches: SlotCaches, toks: list[int]
) -> None:
    first, second = ring(toks)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    pre = caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=1e9))
    assert pre.n_shifted == 0 and pre.n_evaluated == len(second)
    assert caches.slots[0].exact == len(second) == pre.n_exact
    np.testing.assert_allclose(warm_logits(caches), cold_logits(model, second), atol=ATOL)


def test_the_budget_is_the_extra_cost_at_the_measured_price(
    caches: SlotCaches, toks: list[int]
) -> None:
    first, second = ring(toks)
    extra = len(second) - 1  # the shift plan evaluates the last token, the exact one all
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    short = caches.ms_per_token * (extra - 1)
    assert (
        caches.prefill(
            caches.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=short)
        ).n_shifted
        > 0
    )
    caches.clear(caches.slots[0])
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    enough = caches.ms_per_token * extra * 1.001
    assert (
        caches.prefill(
            caches.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=enough)
        ).n_shifted
        == 0
    )


def test_an_unmeasured_price_affords_nothing(caches: SlotCaches, toks: list[int]) -> None:
    first, second = ring(toks)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    caches.ms_per_token = -1.0
    assert (
        caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=1e9)).n_shifted
        > 0
    )
    assert caches.affordable(0, 0.0) and not caches.affordable(1, 1e9)


def test_a_later_prefill_repays_an_earlier_shift(
    model: Model, caches: SlotCaches, toks: list[int]
) -> None:
    first, second = ring(toks)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    caches.prefill(caches.slots[0], second, PrefillPolicy(min_chunk=64, exact_ms=0.0))
    more = second + toks[560:580]  # the same text and more: a plain prefix hit
    pre = caches.prefill(caches.slots[0], more, PrefillPolicy(min_chunk=64, exact_ms=1e9))
    assert pre.n_cached == 0 and pre.n_evaluated == len(more)
    assert caches.slots[0].exact == len(more)
    np.testing.assert_allclose(warm_logits(caches), cold_logits(model, more), atol=ATOL)


def test_exactness_is_tracked_through_append_truncate_and_a_partial_shift(
    caches: SlotCaches, toks: list[int]
) -> None:
    first, _ = ring(toks)
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    caches.append(caches.slots[0], toks[580:584], logits="last")
    assert caches.slots[0].exact == len(first) + 4
    caches.truncate(caches.slots[0], 50)
    assert caches.slots[0].exact == 50
    # a prefix kept in place, then new text, then a moved run: exact up to the run
    caches.prefill(caches.slots[0], first, PrefillPolicy(min_chunk=64))
    edited = first[:120] + toks[580:590] + first[120:]
    pre = caches.prefill(caches.slots[0], edited, PrefillPolicy(min_chunk=64, exact_ms=0.0))
    assert pre.n_shifted > 0 and caches.slots[0].exact == 130
    caches.clear(caches.slots[0])
    assert caches.slots[0].exact == 0


def test_a_ring_warm_up_repairs_the_held_context_when_it_is_affordable(
    qwen_target: Path, toks: list[int]
) -> None:
    """The editor's warm-up (n_predict 0, the ring only) after a shift: the slot holds the ring
    and the cursor's context behind it; idle time re-evaluates all of it exactly and keeps it."""
    first, second = ring(toks)
    kept_len = 300
    settings = EngineSettings(target=ms(qwen_target), cache_reuse=64, spec=SpecSettings("off"))
    with Engine.load(settings) as eng:
        tcache = eng.pair.tcache
        eng.generate(GenerationRequest(slot=0, prompt=first, n_predict=0))
        tcache.ms_per_token = -1.0  # unmeasured: this rotation is shifted
        shifted = eng.generate(GenerationRequest(slot=0, prompt=second, n_predict=0))
        assert shifted.n_shifted > 0 and tcache.slots[0].exact == 0
        assert shifted.n_approx == len(second)
        tcache.ms_per_token = CHEAP  # whatever this CPU measured: the repair fits the budget
        warm_up = eng.generate(GenerationRequest(slot=0, prompt=second[:kept_len], n_predict=0))
        assert warm_up.n_evaluated == len(second) and warm_up.n_cached == 0
        assert warm_up.n_approx == 0
        assert tcache.slots[0].tokens == second and tcache.slots[0].exact == len(second)
        np.testing.assert_allclose(
            np.array(eng.pair.tctx.logits(-1)), cold_logits(eng.pair.target, second), atol=ATOL
        )
        # exact already: the next warm-up evaluates nothing and keeps what follows
        again = eng.generate(GenerationRequest(slot=0, prompt=second[:kept_len], n_predict=0))
        assert again.n_evaluated == 0 and tcache.slots[0].tokens == second and again.n_approx == 0


def test_a_repair_cut_short_keeps_the_cache_consistent(qwen_target: Path, toks: list[int]) -> None:
    """A completion arriving stops a warm-up's repair: the slot keeps what was re-evaluated,
    all of it exact, and the next request evaluates the rest."""
    first, second = ring(toks)
    settings = EngineSettings(
        target=ms(qwen_target), cache_reuse=64, prefill_chunk=32, spec=SpecSettings("off")
    )
    with Engine.load(settings) as eng:
        tcache = eng.pair.tcache
        eng.generate(GenerationRequest(slot=0, prompt=first, n_predict=0))
        tcache.ms_per_token = -1.0
        eng.generate(GenerationRequest(slot=0, prompt=second, n_predict=0))  # shifted
        tcache.ms_per_token = CHEAP
        stop = threading.Event()
        stop.set()
        cut = eng.generate(
            GenerationRequest(slot=0, prompt=second[:300], n_predict=0), prefill_cancel=stop
        )
        assert cut.cancelled and tcache.slots[0].tokens == [] and tcache.slots[0].exact == 0
        assert cut.n_approx == 0  # nothing held, so nothing approximate (the request log's)
        done = eng.generate(GenerationRequest(slot=0, prompt=second, n_predict=0))
        assert done.n_evaluated == len(second) and done.n_approx == 0
        np.testing.assert_allclose(
            np.array(eng.pair.tctx.logits(-1)), cold_logits(eng.pair.target, second), atol=ATOL
        )

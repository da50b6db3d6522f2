"""Slot caches: prefix reuse, chunk and tail reuse, rollback of rejected drafts, cancel.

"Consistent" is checked the strict way: after the operation, the slot's KV is used to
evaluate more tokens and the resulting logits must equal a cold evaluation of the same
sequence (leftover KV from a rejected draft would change them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from localspec.bench.corpus import code_prompts
from localspec.engine import (
    Engine,
    EngineSettings,
    GenerationRequest,
    ModelSettings,
    SamplingParams,
    SpecSettings,
)
from localspec.engine.cache import piece_end
from localspec.engine.completion import Completion
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.types import GenerationResult
from tests.fixtures.models import follow_chain
from tests.steer import fixed_costs

GREEDY = SamplingParams(top_k=1, temperature=0.0)


def ms(path: Path) -> ModelSettings:
    return ModelSettings(str(path), n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=2)


@pytest.fixture(scope="module")
def prompt_text() -> str:
    return "".join(code_prompts(3, lines=12))


@pytest.fixture(scope="module")
def engine(qwen_target: Path, qwen_draft: Path) -> Engine:
    s = EngineSettings(
        target=ms(qwen_target),
        draft=ms(qwen_draft),
        n_slots=2,
        cache_reuse=16,
        tail_reuse=8,
        exact_ms=0.0,  # these tests are of the KV shift, which this tiny model can afford to skip
        # sequential drafting on any number of cores (the pipelined draft: test_engine_pipeline)
        spec=SpecSettings(mode="draft", n_max=4, p_min=0.0, pipeline=False),
    )
    with Engine.load(s) as eng:
        yield eng


@pytest.fixture(scope="module")
def cold(qwen_target: Path) -> Context:
    """The target alone in a fresh context: the reference for logits."""
    model = Model(ms(qwen_target))
    ctx = Context(model, ms(qwen_target), n_seq=1, n_ctx_total=1024, clock=Clock())
    yield ctx
    ctx.close()
    model.close()


def cold_logits(cold: Context, tokens: list[int]) -> np.ndarray:
    cold.seq_rm(0, -1, -1)
    for i in range(0, len(tokens), 256):
        part = tokens[i : i + 256]
        cold.decode(part, i, 0, logits="last" if i + 256 >= len(tokens) else "none")
    return np.array(cold.logits(-1))


def warm_logits(engine: Engine, slot: int, tokens: list[int]) -> np.ndarray:
    """Evaluate ``tokens`` on the slot's current cache (prefix reuse only) and read logits."""
    res = engine.generate(GenerationRequest(slot=slot, prompt=tokens, n_predict=0))
    assert res.n_cached == len(engine.slot_tokens(slot)) - res.n_evaluated
    return np.array(engine.pair.tctx.logits(-1))


def assert_slot_consistent(engine: Engine, slot: int) -> None:
    toks = engine.slot_tokens(slot)
    assert engine.pair.tctx.seq_pos_max(slot) == len(toks) - 1
    if engine.pair.dcache is not None:
        d = engine.draft_slot_tokens(slot)
        assert engine.pair.dctx.seq_pos_max(slot) == len(d) - 1


def test_identical_prompt_evaluates_at_most_one_token(engine: Engine, prompt_text: str) -> None:
    prompt = engine.vocab.tokenize(prompt_text)
    engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
    again = engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
    assert again.n_evaluated <= 1 and again.n_cached == len(prompt) - 1
    assert engine.slot_tokens(0) == prompt


def test_appended_prompt_evaluates_only_new_tokens(engine: Engine, prompt_text: str) -> None:
    prompt = engine.vocab.tokenize(prompt_text)
    engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
    more = prompt + engine.vocab.tokenize("\n    def extra(self):\n        return 1\n")
    res = engine.generate(GenerationRequest(slot=0, prompt=more, n_predict=0))
    assert res.n_evaluated == len(more) - len(prompt)
    assert res.n_cached == len(prompt)


def test_cache_fill_of_a_held_prefix_keeps_what_follows(engine: Engine, prompt_text: str) -> None:
    """n_predict 0 with a prompt the slot holds as a strict prefix: nothing is evaluated and
    the tokens after it stay (an editor's ring warm-up keeps the cursor's cached context)."""
    prompt = engine.vocab.tokenize(prompt_text)
    engine.clear_slot(0)
    engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
    res = engine.generate(GenerationRequest(slot=0, prompt=prompt[:100], n_predict=0))
    assert (res.n_evaluated, res.n_cached) == (0, 100)
    assert engine.slot_tokens(0) == prompt
    res = engine.generate(GenerationRequest(slot=0, prompt=prompt[:100], n_predict=2))
    assert res.n_evaluated == 1 and engine.slot_tokens(0)[:100] == prompt[:100]  # a completion
    assert len(engine.slot_tokens(0)) < len(prompt)  # does not keep the rest
    assert_slot_consistent(engine, 0)


def test_deleted_middle_chunk_is_moved_not_recomputed(
    engine: Engine, cold: Context, prompt_text: str
) -> None:
    toks = engine.vocab.tokenize(prompt_text)
    a, b, c = toks[:60], toks[60:100], toks[100:160]
    engine.generate(GenerationRequest(slot=0, prompt=a + b + c, n_predict=0))
    res = engine.generate(GenerationRequest(slot=0, prompt=a + c, n_predict=0))
    assert res.n_evaluated == 1  # only the last token: C was shifted into place
    assert res.n_shifted == len(c) - 1
    assert engine.slot_tokens(0) == a + c
    assert_slot_consistent(engine, 0)
    # the moved KV is an approximation (it saw B), but a close one
    warm = np.array(engine.pair.tctx.logits(-1))
    ref = cold_logits(cold, a + c)
    assert np.corrcoef(warm, ref)[0, 1] > 0.9


def fim_layout(engine: Engine, prompt_text: str) -> Callable[[str], list[int]]:
    """The editor's layout FIM_PRE prefix LINE FIM_SUF suffix FIM_MID for a cursor line."""
    v = engine.vocab
    f = v.fim
    toks = v.tokenize(prompt_text)
    prefix, suffix = toks[:150], toks[150:230]
    return lambda line: [f.pre, *prefix, *v.tokenize(line), f.suf, *suffix, f.mid]


def test_tail_block_is_kept_when_the_middle_changes(engine: Engine, prompt_text: str) -> None:
    """The editor keystroke: FIM_PRE prefix PROMPT FIM_SUF suffix FIM_MID, PROMPT edited."""
    fim = fim_layout(engine, prompt_text)
    engine.generate(GenerationRequest(slot=0, prompt=fim("    x = compute("), n_predict=0))
    edited = fim("    x = compute(a")
    res = engine.generate(GenerationRequest(slot=0, prompt=edited, n_predict=0))
    changed = len(edited) - res.n_cached - 1
    assert res.n_evaluated == changed + 1 <= 4
    assert res.n_shifted == 80 + 1  # FIM_SUF + the 80 suffix tokens moved, FIM_MID fresh
    assert engine.slot_tokens(0) == edited
    assert_slot_consistent(engine, 0)


def test_with_reuse_off_output_equals_a_cold_context(
    qwen_target: Path, qwen_draft: Path, prompt_text: str
) -> None:
    s = EngineSettings(
        target=ms(qwen_target), draft=ms(qwen_draft), cache_reuse=0, spec=SpecSettings(mode="off")
    )
    with Engine.load(s) as eng:
        toks = eng.vocab.tokenize(prompt_text)
        a, b, c = toks[:60], toks[60:100], toks[100:160]
        eng.generate(GenerationRequest(slot=0, prompt=a + b + c, n_predict=8, sampling=GREEDY))
        warm = eng.generate(GenerationRequest(slot=0, prompt=a + c, n_predict=16, sampling=GREEDY))
        assert warm.n_cached == len(a) and warm.n_shifted == 0
        warm_row = np.array(eng.pair.tctx.logits(-1))
        cold = eng.generate(
            GenerationRequest(
                slot=0, prompt=a + c, n_predict=16, sampling=GREEDY, cache_prompt=False
            )
        )
        assert cold.n_cached == 0
        assert warm.tokens == cold.tokens
        np.testing.assert_allclose(warm_row, np.array(eng.pair.tctx.logits(-1)), atol=0.05)


@pytest.mark.parametrize("reject_at", ["first", "middle", "last"])
def test_rejected_draft_positions_leave_kv_consistent(
    engine: Engine,
    cold: Context,
    prompt_text: str,
    reject_at: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt = engine.vocab.tokenize(prompt_text)[:120]
    ref = engine.generate(
        GenerationRequest(slot=1, prompt=prompt, n_predict=20, sampling=GREEDY, spec_n_max=0)
    ).tokens
    k = 4
    bad_at = {"first": 0, "middle": 2, "last": k - 1}[reject_at]

    def propose(self: Completion, room: int) -> tuple[str, str, list[int]]:
        n = len(self.out)
        draft = ref[n : n + k]
        if len(draft) < k:
            return "", "", []
        draft = list(draft)
        draft[bad_at] = (draft[bad_at] + 1) % 1000  # certainly not the target's choice
        return "draft", "draft", draft

    monkeypatch.setattr(Completion, "_propose", propose)
    res = engine.generate(
        GenerationRequest(slot=0, prompt=prompt, n_predict=20, sampling=GREEDY, cache_prompt=False)
    )
    monkeypatch.undo()
    assert res.tokens == ref
    assert res.spec_steps and all(acc == bad_at for _, _, acc in res.spec_steps)
    assert engine.slot_tokens(0) == prompt + res.tokens[:-1]
    assert_slot_consistent(engine, 0)
    more = prompt + res.tokens + engine.vocab.tokenize(" + 1\n")
    np.testing.assert_allclose(warm_logits(engine, 0, more), cold_logits(cold, more), atol=0.05)


def test_draft_model_kv_keeps_only_accepted_tokens(
    qwen_follow: Path, qwen_follow_draft: Path, prompt_text: str
) -> None:
    """The follow pair: the draft model misses every third token, so its drafts are rejected
    at known places on any CPU; its cache then holds accepted tokens only."""
    s = EngineSettings(
        target=ms(qwen_follow),
        draft=ms(qwen_follow_draft),
        spec=SpecSettings(mode="draft", n_max=4, p_min=0.0, pipeline=False),
    )
    with Engine.load(s) as eng:
        prompt = eng.vocab.tokenize(prompt_text)[:100]
        res = eng.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=24, sampling=GREEDY))
        assert res.tokens == follow_chain(prompt[-1], 24)
        stats = res.drafted["draft"]
        assert 0 < stats.accepted < stats.drafted  # acceptances and rejections
        d = eng.draft_slot_tokens(0)
        seq = prompt + res.tokens
        assert d == seq[: len(d)] and len(d) >= len(prompt)
        assert_slot_consistent(eng, 0)


def test_cancel_returns_partial_output_and_consistent_caches(
    engine: Engine, cold: Context, prompt_text: str
) -> None:
    prompt = engine.vocab.tokenize(prompt_text)[:90]
    cancel = threading.Event()
    seen: list[int] = []

    def on_token(ev: object) -> None:
        seen.append(ev.token)
        if len(seen) >= 3:
            cancel.set()

    res = engine.generate(
        GenerationRequest(slot=0, prompt=prompt, n_predict=50, sampling=GREEDY, cache_prompt=False),
        cancel=cancel,
        on_token=on_token,
    )
    assert res.cancelled and res.stop_type == "none"
    assert 3 <= len(res.tokens) < 50 and seen == res.tokens
    assert engine.slot_tokens(0) == prompt + res.tokens[:-1]
    assert_slot_consistent(engine, 0)
    more = prompt + res.tokens
    np.testing.assert_allclose(warm_logits(engine, 0, more), cold_logits(cold, more), atol=0.05)


def test_cancel_before_prompt_keeps_the_cache_usable(engine: Engine, prompt_text: str) -> None:
    prompt = engine.vocab.tokenize(prompt_text)
    cancel = threading.Event()
    cancel.set()
    res = engine.generate(
        GenerationRequest(slot=0, prompt=prompt, n_predict=5, cache_prompt=False), cancel=cancel
    )
    assert res.cancelled and res.tokens == []
    assert_slot_consistent(engine, 0)


def test_slots_are_independent(engine: Engine, prompt_text: str) -> None:
    toks = engine.vocab.tokenize(prompt_text)
    engine.clear_slot(1)
    engine.generate(GenerationRequest(slot=1, prompt=toks[:80], n_predict=0))
    engine.generate(GenerationRequest(slot=0, prompt=toks[40:200], n_predict=4, sampling=GREEDY))
    res = engine.generate(GenerationRequest(slot=1, prompt=toks[:80], n_predict=0))
    assert res.n_evaluated == 1
    assert_slot_consistent(engine, 0)
    assert_slot_consistent(engine, 1)


def test_stream_equals_text_and_stop_string_trims(engine: Engine, prompt_text: str) -> None:
    prompt = engine.vocab.tokenize(prompt_text)[:80]
    base = engine.generate(
        GenerationRequest(slot=0, prompt=prompt, n_predict=12, sampling=GREEDY, spec_n_max=0)
    )
    word = base.text[len(base.text) // 2 :][:3]
    assert word
    pieces: list[str] = []
    res = engine.generate(
        GenerationRequest(slot=0, prompt=prompt, n_predict=12, sampling=GREEDY, stop=(word,)),
        on_token=lambda ev: pieces.append(ev.text),
    )
    assert res.stop_type == "word" and res.stopping_word == word
    assert res.text == base.text[: base.text.index(word)]
    assert "".join(pieces) == res.text


@pytest.mark.parametrize("refresh", [0, 16])
def test_tail_drift_is_bounded(qwen_target: Path, prompt_text: str, refresh: int) -> None:
    """Typing in front of a short tail block: shifted while little changed, then recomputed."""
    s = EngineSettings(
        target=ms(qwen_target),
        cache_reuse=256,
        exact_ms=0.0,
        tail_reuse=8,
        tail_max_drift=3,
        tail_refresh=refresh,
        tail_roll=0,
        spec=SpecSettings(mode="off"),
    )
    with Engine.load(s) as eng:
        v = eng.vocab
        f = v.fim
        toks = v.tokenize(prompt_text)
        prefix, suffix = toks[:100], toks[100:160]
        evaluated = []
        for word in ["alpha", " beta", " gamma", " delta", " epsilon", " zeta", " eta"]:
            prefix = prefix + v.tokenize(word)
            prompt = [f.pre, *prefix, f.suf, *suffix, f.mid]
            res = eng.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
            evaluated.append(res.n_evaluated)
            assert eng.slot_tokens(0) == prompt
        # first request cold; then each word costs its own tokens + FIM_MID, until the drift
        # budget (3 tokens) is spent and the suffix block is recomputed once
        recomputed = [n for n in evaluated[1:] if n > len(suffix)]
        shifted = [n for n in evaluated[1:] if n <= 4 + refresh]
        assert recomputed and shifted
        assert len(recomputed) < len(shifted)


def test_rolling_refresh_recomputes_a_window_per_keystroke_instead_of_the_block(
    qwen_target: Path, prompt_text: str
) -> None:
    """Each keystroke re-evaluates the changed tokens, the block's head and one rolling window;
    the windows cover the block within a few keys, so the drift cap (counted over one cycle)
    never forces the whole-block recompute that the cumulative cap does."""
    results = {}
    for roll in (0, 16):
        s = EngineSettings(
            target=ms(qwen_target), cache_reuse=256, tail_reuse=8, tail_max_drift=6,
            tail_refresh=4, tail_roll=roll, exact_ms=0.0, spec=SpecSettings(mode="off"),
        )  # fmt: skip
        with Engine.load(s) as eng:
            v, f = eng.vocab, eng.vocab.fim
            toks = v.tokenize(prompt_text)
            prefix, suffix = toks[:100], toks[100:164]
            evaluated = []
            for ch in "abcdefghijkl":
                prefix = [*prefix, *v.tokenize(ch)]
                prompt = [f.pre, *prefix, f.suf, *suffix, f.mid]
                res = eng.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
                evaluated.append(res.n_evaluated)
                assert eng.slot_tokens(0) == prompt
                assert_slot_consistent(eng, 0)
            results[roll] = evaluated[1:]
    n_block = len(suffix) + 1  # FIM_SUF + suffix
    assert max(results[0]) > n_block  # the cumulative cap recomputed the block
    assert max(results[16]) <= 2 + 4 + 16 + 1  # a key, the head, one window, FIM_MID
    assert min(results[16]) > 4 + 1  # the window is really evaluated


class _CancelAfter(threading.Event):
    """Reads as set from the ``n``-th check on: a client that leaves mid-prefill."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.checks, self.n = 0, n

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.n


def test_cancel_before_a_moved_tail_block_still_attaches_it(
    engine: Engine, prompt_text: str
) -> None:
    """A keystroke aborted just after its plan: the few changed tokens in front of the moved
    suffix block are evaluated and the block attached, so the next keystroke still has it."""
    fim = fim_layout(engine, prompt_text)
    engine.generate(GenerationRequest(slot=1, prompt=fim("    y = total("), n_predict=0))
    edited = fim("    y = total(b")
    res = engine.generate(
        GenerationRequest(slot=1, prompt=edited, n_predict=4, sampling=GREEDY),
        cancel=_CancelAfter(1),
    )
    assert res.cancelled and res.tokens == []
    assert engine.slot_tokens(1) == edited[:-1]  # all but FIM_MID: the block is still there
    assert_slot_consistent(engine, 1)
    again = engine.generate(GenerationRequest(slot=1, prompt=edited, n_predict=0))
    assert again.n_evaluated == 1


def test_cancel_finishes_the_gaps_in_front_of_parked_runs_when_they_are_worth_more(
    qwen_target: Path, prompt_text: str
) -> None:
    """A ring chunk inserted in front of 400 cached tokens: a keystroke cancelled before the
    moved tokens were attached evaluates the 150-token gap (five pieces) and attaches them,
    instead of dropping 400 tokens of KV that the next keystroke would recompute."""
    s = EngineSettings(target=ms(qwen_target), cache_reuse=64, prefill_chunk=32, exact_ms=0.0)
    with Engine.load(s) as eng:
        toks = eng.vocab.tokenize("".join(code_prompts(16, lines=14)))
        assert len(toks) >= 850
        a, x, bc = toks[:300], toks[300:450], toks[450:850]
        eng.generate(GenerationRequest(slot=0, prompt=[*a, *bc], n_predict=0))
        prompt = [*a, *x, *bc, 13]
        res = eng.generate(
            GenerationRequest(slot=0, prompt=prompt, n_predict=4), cancel=_CancelAfter(1)
        )
        assert res.cancelled and res.n_shifted == len(bc)
        assert eng.slot_tokens(0) == prompt[:-1]
        assert_slot_consistent(eng, 0)
        again = eng.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
        assert again.n_evaluated == 1


def test_partly_evaluated_suffix_block_is_kept_by_the_next_keystroke(
    engine: Engine, prompt_text: str
) -> None:
    v = engine.vocab
    f = v.fim
    toks = v.tokenize(prompt_text)
    prefix, suffix = toks[:150], toks[150:230]
    line1, line2 = v.tokenize("    z = mean("), v.tokenize("    z = mean(c")
    # what an aborted keystroke leaves: its prompt up to 60 tokens into the suffix block
    engine.generate(GenerationRequest(slot=0, prompt=[f.pre, *prefix, *line1, f.suf, *suffix[:60]],
                                      n_predict=0))  # fmt: skip
    prompt = [f.pre, *prefix, *line2, f.suf, *suffix, f.mid]
    res = engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
    assert res.n_shifted > 0  # part of the 61-token block start (less its refresh) moved
    assert res.n_evaluated < len(suffix)
    assert engine.slot_tokens(0) == prompt
    assert_slot_consistent(engine, 0)


def test_a_prompt_is_cut_into_pieces_of_one_size() -> None:
    """As many pieces as ``chunk``-sized ones would take, all of one size: llama.cpp's CPU
    flash attention runs fewer than 64 query rows row by row, so 308 tokens as 128 + 128 + 52
    cost as much as three full pieces."""

    def pieces(n: int, step: int) -> list[int]:
        out, pos = [], 0
        while pos < n:
            end = piece_end(pos, n, step)
            out.append(end - pos)
            pos = end
        return out

    assert pieces(308, 128) == [103, 103, 102]
    assert pieces(129, 128) == [65, 64]
    assert pieces(160, 32) == [32] * 5
    assert pieces(100, 128) == [100]
    assert pieces(1, 128) == [1]


def test_cancel_mid_prefill_stops_between_pieces_and_keeps_what_was_evaluated(
    qwen_target: Path, prompt_text: str
) -> None:
    settings = EngineSettings(target=ms(qwen_target), prefill_chunk=32, cache_reuse=0)
    with Engine.load(settings) as eng:
        prompt = eng.vocab.tokenize(prompt_text)[:160]
        res = eng.generate(
            GenerationRequest(slot=0, prompt=prompt, n_predict=8, sampling=GREEDY),
            cancel=_CancelAfter(3),
        )
        # two pieces of 32 were evaluated before the third check saw the cancel
        assert res.cancelled and res.tokens == [] and res.n_evaluated == 64
        assert eng.slot_tokens(0) == prompt[:64]
        again = eng.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
        assert again.n_cached == 64 and again.n_evaluated == len(prompt) - 64
        assert_slot_consistent(eng, 0)


def test_auto_mode_skips_a_draft_prefill_that_does_not_pay(
    qwen_follow: Path, qwen_follow_draft: Path, prompt_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a new location the draft model would first evaluate the whole new prompt; auto mode
    weighs that against what its drafts can save and, when it does not pay, generates without
    it (same greedy output), leaving the draft's cache as it was. (The follow pair: its greedy
    output is known, so "the same" cannot turn on a near tie.)"""
    # whatever this CPU measures: a 5-token step at 1.2x a single token's time and free draft
    # tokens, so drafts pay and the prefill rule alone decides
    fixed_costs(monkeypatch, {1: 10.0, 5: 12.0}, draft_ms=0.0)
    s = EngineSettings(
        target=ms(qwen_follow),
        draft=ms(qwen_follow_draft),
        n_slots=1,
        # auto's cost model, drafting sequentially on any number of cores (a pipelined draft
        # prefills beside the target and is never skipped)
        spec=SpecSettings(mode="draft", adaptive=True, n_max=4, pipeline=False),
        follow_load=False,  # step costs are kept per thread count: one count throughout
    )
    with Engine.load(s) as eng:
        first = eng.vocab.tokenize(prompt_text)
        other = eng.vocab.tokenize("# another file\n" + "".join(code_prompts(5, lines=12)[3:]))

        def run(prompt: list[int]) -> GenerationResult:
            return eng.generate(
                GenerationRequest(slot=0, prompt=prompt, n_predict=24, sampling=GREEDY)
            )

        run(first)
        (policy,) = eng.pair._policies.values()
        assert policy.target_prefill_ms > 0  # the target's price, measured on its prefill

        def worth_drafting() -> None:
            """A draft model whose drafts are all accepted (and cost nothing)."""
            policy.sources.pop("draft", None)
            for _ in range(12):
                policy.observe_result("draft", 4, 4)
            policy.source("draft").cost_ms = 0.0
            assert policy.plan("draft", allow_probe=False) == 4

        before = eng.draft_slot_tokens(0)
        worth_drafting()
        policy.draft_prefill_ms = 1e6  # but a prefill that never pays
        skipped = run(other)
        assert skipped.draft_n_evaluated == 0 and skipped.draft_prompt_ms == 0.0
        assert eng.draft_slot_tokens(0) == before
        worth_drafting()
        policy.draft_prefill_ms, policy.target_prefill_ms = -1.0, 1e6  # the target's price
        assert run(other).draft_n_evaluated == 0  # stands in for the unmeasured draft's
        worth_drafting()
        policy.draft_prefill_ms = 1e-6  # one that always does
        paid = run(other)
        assert paid.draft_n_evaluated > 64 and paid.tokens == skipped.tokens
        assert paid.tokens == follow_chain(other[-1], 24)


def test_drafts_never_exceed_the_batch(qwen_follow: Path) -> None:
    """An n-gram draft can be as long as any ``n_max`` a request asks for; the verify batch
    ``[last, *draft]`` still fits ``n_batch`` (the fuzzer found a 65-token batch). The follow
    model continues the prompt's opening run, so the n-gram match is there on any CPU."""
    small = ModelSettings(str(qwen_follow), n_ctx=1024, n_batch=32, n_ubatch=32, n_threads=2)
    s = EngineSettings(target=small, spec=SpecSettings(mode="ngram", n_max=16))
    with Engine.load(s) as eng:
        start = 1000
        prompt = [*follow_chain(start - 1, 300), start]  # start, start + 1, ..., then start
        res = eng.generate(
            GenerationRequest(slot=0, prompt=prompt, n_predict=200, sampling=GREEDY, spec_n_max=100)
        )
        assert res.tokens == follow_chain(start, 200)
        assert res.spec_steps and max(n for _, n, _ in res.spec_steps) == 31


@pytest.mark.parametrize("cache_reuse", [16, 0])
def test_a_ring_warm_up_under_a_changed_ring_moves_the_cursor_context_when_shifts_may(
    qwen_target: Path, prompt_text: str, cache_reuse: int
) -> None:
    """An editor's warm-up (n_predict 0: the ring, then an empty frame) after its ring gained
    a chunk: the cursor's context the slot holds moves behind the new ring, so the next
    keystroke evaluates its typed token only. Without KV shifts (``--cache-reuse 0``) the
    warm-up caches the ring alone, as before: moving the context would mean evaluating it."""
    s = EngineSettings(target=ms(qwen_target), n_slots=1, cache_reuse=cache_reuse, exact_ms=0.0)
    with Engine.load(s) as eng:
        toks = eng.vocab.tokenize(prompt_text)
        a, b, c, tail = toks[:40], toks[40:80], toks[80:120], toks[120:320]
        assert len(tail) == 200

        def ask(ring: list[list[int]], rest: list[int], n_predict: int) -> GenerationResult:
            prompt = [t for chunk in ring for t in chunk] + rest
            blocks = tuple(len(chunk) for chunk in ring)
            req = GenerationRequest(slot=0, prompt=prompt, n_predict=n_predict, blocks=blocks)
            return eng.generate(req)

        ask([a, b], tail, 0)
        warm = ask([b, c], tail[:3], 0)  # the ring gained c (and lost a); an empty frame
        key = ask([b, c], [*tail, toks[5]], 1)
        if cache_reuse:
            assert warm.n_shifted >= len(tail) - 1 and key.n_evaluated <= 2
        else:
            # (b moves to position 0 only by a shift: evaluated again with c and the frame)
            assert warm.n_evaluated <= len(b) + len(c) + 3 and key.n_evaluated > len(tail) - 3

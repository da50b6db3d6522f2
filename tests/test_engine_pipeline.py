"""The pipelined draft: the draft model drafting on its own thread while the target verifies.

Exactness is the target's own (greedy re-scoring, seeded sampling); the draft's cache must
hold only verified tokens once the request is over, and its KV must be what those tokens
compute (checked against a cold draft context), after forced rejections, cancels and a
request that ends before the draft thread finished its prefill.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace
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
    Task,
)
from localspec.engine.engine import draft_window_start
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.pipeline import DraftPipeline
from localspec.engine.threads import physical_cores
from tests.cpu_support import OtherLoad
from tests.fixtures.models import follow_chain
from tests.steer import fixed_costs
from tests.test_engine_exact import Scorer, run_exactness

GREEDY = SamplingParams(top_k=1, temperature=0.0)


def ms(path: Path, threads: int = 1) -> ModelSettings:
    return ModelSettings(str(path), n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=threads)


def settings(target: Path, draft: Path, **spec: object) -> EngineSettings:
    return EngineSettings(
        target=ms(target),
        draft=ms(draft),
        n_slots=2,
        # the tiny draft is as fast as the tiny target: the target waits for its tokens
        spec=SpecSettings(
            **{"mode": "draft", "n_max": 4, "p_min": 0.0, "pipeline": True, "pipeline_wait": 2}
            | spec
        ),
    )


@pytest.fixture(scope="module")
def engine(qwen_target: Path, qwen_draft: Path) -> Engine:
    with Engine.load(settings(qwen_target, qwen_draft)) as eng:
        yield eng


@pytest.fixture(scope="module")
def cold_draft(qwen_draft: Path) -> Context:
    model = Model(ms(qwen_draft))
    ctx = Context(model, ms(qwen_draft), n_seq=1, n_ctx_total=1024, clock=Clock())
    yield ctx
    ctx.close()
    model.close()


def last_logits(ctx: Context, seq: int, tokens: list[int], start: int = 0) -> np.ndarray:
    for i in range(start, len(tokens), 256):
        part = tokens[i : i + 256]
        ctx.decode(part, i, seq, logits="last" if i + 256 >= len(tokens) else "none")
    return np.array(ctx.logits(-1))


def assert_draft_cache_exact(
    engine: Engine, cold: Context, slot: int, prompt: list[int], out: list[int]
) -> None:
    """The draft's cache holds a prefix of the verified sequence (its window of the prompt +
    the output), its KV positions match its token list, and decoding one more token on it
    gives what a cold draft context gives."""
    start = draft_window_start(len(prompt), engine.settings.spec.draft_window)
    seq = prompt[start:] + out
    d = engine.draft_slot_tokens(slot)  # joins the draft thread
    assert d == seq[: len(d)]
    assert engine.pair.dctx.seq_pos_max(slot) == len(d) - 1
    if not d:
        return
    probe = [*d, seq[len(d)] if len(d) < len(seq) else d[-1]]
    dcache = engine.pair.dcache
    dcache.append(dcache.slots[slot], probe[-1:], logits="last")
    warm = np.array(engine.pair.dctx.logits(-1))
    dcache.truncate(dcache.slots[slot], len(d))
    cold.seq_rm(0, -1, -1)
    np.testing.assert_allclose(warm, last_logits(cold, 0, probe), atol=0.05)


def test_pipeline_is_on_by_default_only_with_a_free_core(
    qwen_target: Path, qwen_draft: Path
) -> None:
    """One thread each on a machine with two free cores: pipelined; the same with one core
    taken by another process, or with each context on all cores: not (unless asked)."""
    one = settings(qwen_target, qwen_draft, pipeline=None)
    cores = physical_cores()
    load = OtherLoad()
    with Engine.load(one) as eng:
        eng.governor = load.governor(cores)
        load.run(seconds=1.0, other_cores=0.0)
        assert eng.pipeline_enabled() == (cores >= 2)
        load.run(seconds=1.0, other_cores=cores - 1.0)  # one core left
        assert not eng.pipeline_enabled()
    full = replace(one, target=ms(qwen_target, cores), draft=ms(qwen_draft, cores))
    with Engine.load(full) as eng:
        assert not eng.pipeline_enabled()
        assert eng.pipeline_enabled(replace(full.spec, pipeline=True))


def test_low_agreement_pair_is_target_exact_pipelined(engine: Engine, qwen_target: Path) -> None:
    scorer = Scorer(qwen_target)
    try:
        total = run_exactness(engine, scorer, code_prompts(12, lines=8), 12)
    finally:
        scorer.close()
    assert total["bad"] == 0, total
    assert total["drafted"] > 30


def test_rejected_pipelined_drafts_stay_target_exact(
    qwen_follow: Path, qwen_follow_draft: Path
) -> None:
    """The follow pair: the draft thread's chain goes wrong on every third token, so drafts
    are cut at known places; the output is still the target's own (and known)."""
    scorer = Scorer(qwen_follow)
    try:
        with Engine.load(settings(qwen_follow, qwen_follow_draft)) as eng:
            prompts = code_prompts(6, lines=8)
            total = run_exactness(eng, scorer, prompts, 12)
            prompt = eng.vocab.tokenize(prompts[0])[-200:]
            res = eng.generate(
                GenerationRequest(slot=1, prompt=prompt, n_predict=12, sampling=GREEDY)
            )
            assert res.pipelined and res.tokens == follow_chain(prompt[-1], 12)
    finally:
        scorer.close()
    assert total["bad"] == 0, total
    assert 0 < total["accepted"] < total["drafted"]


def test_high_agreement_pair_is_target_exact_pipelined(
    smollm_f32: Path, smollm_q4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # auto's cost model with the costs of a CPU where a batch of k + 1 costs (1 + k / 8)
    # single steps: drafting pays, whatever this machine and its load measure
    fixed_costs(monkeypatch, {1: 8.0, 2: 9.0, 5: 12.0, 9: 16.0, 17: 24.0})
    # (step costs are kept per thread count: one count throughout)
    s = replace(settings(smollm_f32, smollm_q4, mode="auto", n_max=8), follow_load=False)
    scorer = Scorer(smollm_f32)
    try:
        with Engine.load(s) as eng:
            total = run_exactness(eng, scorer, code_prompts(4, lines=4), 16)
            res = eng.generate(
                GenerationRequest(slot=0, prompt=eng.vocab.tokenize("def f(x):\n"), n_predict=4)
            )
            assert res.pipelined
    finally:
        scorer.close()
    assert total["bad"] == 0, total
    assert total["accepted"] > 0.5 * total["drafted"] > 8


def test_seeded_sampling_is_the_same_pipelined(engine: Engine) -> None:
    sampling = SamplingParams(top_k=40, top_p=1.0, min_p=0.0, temperature=10.0, seed=1234)
    prompt = engine.vocab.tokenize(code_prompts(1, lines=8)[0])
    outs = {}
    spec = engine.settings.spec
    try:
        for mode in ("off", "draft", "hybrid", "auto"):
            engine.settings = replace(engine.settings, spec=replace(spec, mode=mode))
            res = engine.generate(
                GenerationRequest(
                    slot=0, prompt=prompt, n_predict=32, sampling=sampling, cache_prompt=False
                )
            )
            outs[mode] = res
    finally:
        engine.settings = replace(engine.settings, spec=spec)
    assert outs["draft"].pipelined and outs["draft"].draft_n > 0
    for mode in ("draft", "hybrid", "auto"):
        assert outs[mode].tokens == outs["off"].tokens, mode


def test_steered_rejections_leave_both_caches_exact(
    engine: Engine, cold_draft: Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every third guess of the draft thread is wrong: at the first, middle and last draft
    positions and as the bonus guess; outputs stay the target's and no rejected token
    stays in the draft's cache."""
    prompt = engine.vocab.tokenize("".join(code_prompts(2, lines=10)))[:150]
    ref = engine.generate(
        GenerationRequest(slot=1, prompt=prompt, n_predict=30, sampling=GREEDY, spec_n_max=0)
    ).tokens
    calls = itertools.count()
    pick = DraftPipeline.pick

    def steered(row: np.ndarray) -> tuple[int, float]:
        tok, _ = pick(row)
        return ((tok + 1) % 1000, 1.0) if next(calls) % 3 == 2 else (tok, 1.0)

    monkeypatch.setattr(DraftPipeline, "pick", staticmethod(steered))
    res = engine.generate(
        GenerationRequest(slot=0, prompt=prompt, n_predict=30, sampling=GREEDY, cache_prompt=False)
    )
    assert_draft_cache_exact(engine, cold_draft, 0, prompt, res.tokens)
    monkeypatch.undo()
    assert res.pipelined and res.tokens == ref
    assert res.draft_n_accepted < res.draft_n
    assert res.draft_n_decoded > len(res.tokens)  # the thread drafted (and wasted) ahead
    assert engine.slot_tokens(0) == prompt + res.tokens[:-1]
    assert engine.pair.tctx.seq_pos_max(0) == len(prompt) + len(res.tokens) - 2


def test_cancel_mid_generation_keeps_the_draft_cache_exact(
    engine: Engine, cold_draft: Context
) -> None:
    prompt = engine.vocab.tokenize(code_prompts(3, lines=10)[2])[:120]
    cancel = threading.Event()

    def on_token(ev: object) -> None:
        if len(seen) >= 5:
            cancel.set()
        seen.append(ev)

    seen: list[object] = []
    res = engine.generate(
        GenerationRequest(slot=0, prompt=prompt, n_predict=60, sampling=GREEDY, cache_prompt=False),
        cancel=cancel,
        on_token=on_token,
    )
    assert res.cancelled and 5 <= len(res.tokens) < 60
    assert engine.slot_tokens(0) == prompt + res.tokens[:-1]
    assert_draft_cache_exact(engine, cold_draft, 0, prompt, res.tokens)
    again = engine.generate(
        GenerationRequest(slot=0, prompt=prompt + res.tokens, n_predict=8, sampling=GREEDY)
    )
    assert again.n_evaluated == 1 and len(again.tokens) == 8


def test_request_ending_before_the_draft_prefill_leaves_a_usable_cache(
    engine: Engine, cold_draft: Context
) -> None:
    """A one-token request returns at once; the draft thread's prefill is cut short and the
    next user of the draft cache finds it consistent (then reuses what was evaluated)."""
    prompt = engine.vocab.tokenize("".join(code_prompts(4, lines=20)))[:600]
    engine.clear_slot(1)
    res = engine.generate(GenerationRequest(slot=1, prompt=prompt, n_predict=1, sampling=GREEDY))
    assert len(res.tokens) == 1
    assert_draft_cache_exact(engine, cold_draft, 1, prompt, res.tokens)
    res2 = engine.generate(GenerationRequest(slot=1, prompt=prompt, n_predict=12, sampling=GREEDY))
    assert len(res2.tokens) == 12
    assert_draft_cache_exact(engine, cold_draft, 1, prompt, res2.tokens)


def test_draft_window_and_back_to_back_requests(
    qwen_target: Path, qwen_draft: Path, cold_draft: Context
) -> None:
    """A draft that sees only the prompt's last tokens, several requests in a row on two
    slots (each draft thread first settles the previous one), then a sequential request."""
    s = settings(qwen_target, qwen_draft, draft_window=64)
    with Engine.load(s) as eng:
        toks = eng.vocab.tokenize("".join(code_prompts(3, lines=12)))
        ref = {}
        for slot, cut in ((0, 150), (1, 170), (0, 190), (1, 170)):
            prompt = toks[:cut]
            res = eng.generate(
                GenerationRequest(slot=slot, prompt=prompt, n_predict=10, sampling=GREEDY)
            )
            assert res.pipelined and res.draft_n > 0
            ref.setdefault(cut, res.tokens)
            assert res.tokens == ref[cut]
        assert_draft_cache_exact(eng, cold_draft, 1, toks[:170], ref[170])
        assert len(eng.draft_slot_tokens(1)) < 170
        eng.settings = replace(s, spec=replace(s.spec, pipeline=False))
        res = eng.generate(
            GenerationRequest(slot=1, prompt=toks[:170], n_predict=10, sampling=GREEDY)
        )
        assert not res.pipelined and res.tokens == ref[170]


def test_requests_arriving_together_start_no_draft_thread(
    engine: Engine, cold_draft: Context
) -> None:
    """Two requests queued before the first step share every step from the start: neither
    starts a draft thread (its window prefill would take cores from the shared steps)."""
    texts = code_prompts(6, lines=12)
    prompts = [engine.vocab.tokenize(texts[i])[:150] for i in (4, 5)]
    tasks = [
        Task([GenerationRequest(slot=s, prompt=p, n_predict=8, sampling=GREEDY)])
        for s, p in enumerate(prompts)
    ]
    for task in tasks:
        engine.submit(task)
    while engine.step():
        pass
    for slot, (task, prompt) in enumerate(zip(tasks, prompts, strict=True)):
        (res,) = task.results
        assert not res.pipelined and len(res.tokens) == 8
        assert_draft_cache_exact(engine, cold_draft, slot, prompt, res.tokens)


def test_a_request_joining_a_prompt_prefill_stops_its_draft_thread(
    engine: Engine, cold_draft: Context
) -> None:
    """A request that starts alone drafts on its own thread; once a second one joins while
    the first prompt is still being evaluated, the thread is settled before the next shared
    step, and both answers and caches stay exact."""
    long = engine.vocab.tokenize("".join(code_prompts(5, lines=20)))[:700]
    short = engine.vocab.tokenize(code_prompts(6, lines=12)[5])[:120]
    engine.clear_slot(0)
    first = Task([GenerationRequest(slot=0, prompt=long, n_predict=8, sampling=GREEDY)])
    engine.submit(first)
    engine.step()
    (run,) = engine.scheduler.running
    assert run.steps is not None and run.completions[0].pipe is not None  # prefilling, piped
    second = Task([GenerationRequest(slot=1, prompt=short, n_predict=8, sampling=GREEDY)])
    engine.submit(second)
    engine.step()
    assert engine.pair.draft_job is None
    assert all(c.pipe is None for r in engine.scheduler.running for c in r.completions)
    while engine.step():
        pass
    for slot, task, prompt in ((0, first, long), (1, second, short)):
        (res,) = task.results
        assert len(res.tokens) == 8
        assert_draft_cache_exact(engine, cold_draft, slot, prompt, res.tokens)

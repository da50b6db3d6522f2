"""The languages bench's ceiling (engine/oracle.py): the oracle's choice rule, and on the real
engine with the follow pair (the draft misses after every multiple of 3) it drafts only what
the target accepts, keeps the target's output, and keeps a record of its own."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from localspec.bench.languages import draft_greedy
from localspec.engine import Engine, EngineSettings, GenerationRequest, ModelSettings
from localspec.engine.oracle import DepthOracle
from localspec.engine.policy import VerifyCost
from localspec.engine.types import SamplingParams, SpecSettings
from tests.fixtures.models import follow_chain, follow_next

GREEDY = SamplingParams(top_k=1, temperature=0.0)
PROMPT = [1000, 1001, 1002]


def test_runs_count_the_draft_chain_that_equals_the_target() -> None:
    oracle = DepthOracle.of([5, 6, 7, 8, 9], [5, 6, 0, 8, 9])
    assert oracle.draft_runs == (2, 1, 0, 2, 1)
    assert oracle.accepted(1, [6, 7, 1]) == 2 and oracle.accepted(4, [9, 10]) == 1
    assert oracle.draft_run(5) == 0


def test_choice_weighs_accepted_tokens_per_ms() -> None:
    flat = VerifyCost(ms={1: 10.0, 2: 10.0, 5: 10.0, 9: 10.0})
    assert DepthOracle.choose(0, 0, flat, 1.0) == ("", 0)
    assert DepthOracle.choose(3, 8, flat, 1.0) == ("draft", 8)  # 9 / 18 ms beats 4 / 10 ms
    assert DepthOracle.choose(3, 8, flat, 5.0) == ("ngram", 3)  # 9 / 50 ms does not
    steep = VerifyCost(ms={1: 10.0, 2: 25.0})  # a token more costs more than a step
    assert DepthOracle.choose(1, 0, steep, 0.0) == ("", 0)
    assert DepthOracle.choose(4, 0, VerifyCost(), 0.0) == ("", 0)  # no step measured yet


@pytest.fixture(scope="module")
def engine(qwen_follow: Path, qwen_follow_draft: Path) -> Engine:
    def model(p: Path) -> ModelSettings:
        return ModelSettings(path=str(p), n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=2)

    spec = SpecSettings(mode="auto", n_max=8, pipeline=False)
    settings = EngineSettings(
        target=model(qwen_follow), draft=model(qwen_follow_draft), n_slots=2, spec=spec
    )
    with Engine.load(settings) as eng:
        yield eng


def test_oracle_drafts_only_what_the_target_accepts(engine: Engine) -> None:
    n = 40
    target = follow_chain(PROMPT[-1], n)
    expected = [follow_next(t, 3) for t in [PROMPT[-1], *target[:-1]]]
    greedy, draft_ms = draft_greedy(engine, PROMPT, target)  # one pass over the draft model
    assert greedy == expected and draft_ms > 0
    oracle = DepthOracle.of(target, greedy)
    assert 0 < max(oracle.draft_runs) < n  # the draft misses: not every depth pays
    res = engine.generate(
        GenerationRequest(slot=0, prompt=PROMPT, n_predict=n, sampling=GREEDY, oracle=oracle)
    )
    assert res.tokens == target
    steps = [(d, a) for _, d, a in res.spec_steps]
    assert sum(d for d, _ in steps) > 0 and all(d == a for d, a in steps), steps
    # its record is its own: today's auto policy learnt nothing from it
    spec = engine.settings.spec
    today = engine.pair.policy_for(False, spec, 0.0)
    assert all(len(s.runs) == 0 for s in today.sources.values())
    assert len(engine.pair.policy_for(False, spec, 0.0, oracle=True).source("draft").runs) > 0


def test_relaxed_acceptance_keeps_a_record_of_its_own(engine: Engine) -> None:
    base = engine.settings
    try:
        relaxed = replace(base.spec, accept="topk")
        engine.settings = replace(base, spec=relaxed)
        engine.generate(GenerationRequest(slot=0, prompt=PROMPT, n_predict=24, sampling=GREEDY))
        assert engine.pair.policy_for(False, relaxed, 0.3) is not engine.pair.policy_for(
            False, base.spec, 0.3
        )
    finally:
        engine.settings = base

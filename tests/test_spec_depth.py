"""Depth that follows the context: each language's own acceptance record, and no drafting
while the target is unsure (its entropy high), on the real engine with the follow pair."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from localspec.engine import Engine, EngineSettings, GenerationRequest, ModelSettings
from localspec.engine.policy import SpecPolicy
from localspec.engine.types import SamplingParams, SpecSettings
from localspec.server import ServerSettings, create_app
from tests.fixtures.models import follow_chain
from tests.test_server_http import start, stop

GREEDY = SamplingParams(top_k=1, temperature=0.0)
PROMPT = [1000, 1001, 1002]


def _settings(target: Path, draft: Path, **spec: object) -> EngineSettings:
    def model(p: Path) -> ModelSettings:
        return ModelSettings(path=str(p), n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=2)

    return EngineSettings(
        target=model(target),
        draft=model(draft),
        n_slots=1,
        spec=SpecSettings(mode="auto", n_max=6, pipeline=False, **spec),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def engine(qwen_follow: Path, qwen_follow_draft: Path) -> Engine:
    with Engine.load(_settings(qwen_follow, qwen_follow_draft)) as eng:
        yield eng


def _run(eng: Engine, language: str | None = None, n: int = 24) -> list[int]:
    req = GenerationRequest(
        slot=0, prompt=PROMPT, n_predict=n, sampling=GREEDY, language=language, spec_p_min=0.0
    )
    res = eng.generate(req)
    assert res.tokens == follow_chain(PROMPT[-1], n)  # exact whatever the policy does
    return [d for _, d, _ in res.spec_steps]


def test_each_language_keeps_its_own_acceptance_record(engine: Engine) -> None:
    base = engine.settings
    try:
        engine.settings = replace(base, spec=replace(base.spec, by_language=True))
        spec = engine.settings.spec
        _run(engine, "python")
        py = engine.pair.policy_for(False, spec, 0.0, "python").source("draft").runs
        sh = engine.pair.policy_for(False, spec, 0.0, "shell").source("draft").runs
        assert len(py) > 0 and len(sh) == 0  # python's drafts taught shell's nothing
        _run(engine, "shell")
        assert len(engine.pair.policy_for(False, spec, 0.0, "shell").source("draft").runs) > 0
        # without by_language every request shares one record
        engine.settings = base
        shared = engine.pair.policy_for(False, base.spec, 0.0, "python")
        assert shared is engine.pair.policy_for(False, base.spec, 0.0, "shell")
    finally:
        engine.settings = base


def test_no_drafting_while_the_target_is_unsure(engine: Engine, smollm_q4: Path) -> None:
    # the follow target is sure of every token (entropy ~0): the gate never closes
    base = engine.settings
    try:
        engine.settings = replace(base, spec=replace(base.spec, mode="draft", entropy_max=1.0))
        assert sum(_run(engine)) > 0
    finally:
        engine.settings = base
    # a trained model (SmolLM2, drafting for itself: every draft would be accepted) spreads
    # its probability over tokens, tenths of a nat to several: a gate at 0.001 nat keeps it
    # from drafting at all, one at 100 never closes
    drafted = {}
    with Engine.load(_settings(smollm_q4, smollm_q4)) as eng:
        prompt = eng.vocab.tokenize("Once upon a time")
        for gate in (1e-3, 100.0):
            spec = replace(eng.settings.spec, mode="draft", entropy_max=gate)
            eng.settings = replace(eng.settings, spec=spec)
            res = eng.generate(
                GenerationRequest(
                    slot=0, prompt=prompt, n_predict=16, sampling=GREEDY, spec_p_min=0.0
                )
            )
            drafted[gate] = res.spec_steps
    assert drafted[1e-3] == [] and sum(d for _, d, _ in drafted[100.0]) > 0, drafted


def test_the_server_hands_the_language_to_the_engine(
    qwen_follow: Path, qwen_follow_draft: Path
) -> None:
    settings = _settings(qwen_follow, qwen_follow_draft, by_language=True)
    live = start(create_app(ServerSettings(port=0), settings))
    try:
        with live.client() as c:
            r = c.post(
                "/completion",
                json={"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                      "language": "rust", "speculative.p_min": 0.0},
            )  # fmt: skip
            assert r.status_code == 200, r.text
        engine = live.service.worker.engine
        pair = engine.pair  # type: ignore[attr-defined]
        rust = pair.policy_for(False, settings.spec, 0.0, "rust").source("draft").runs
        assert len(rust) > 0
    finally:
        stop(live)


def test_ngram_drafts_end_where_the_context_disagrees(engine: Engine) -> None:
    """``ngram_agree`` on the real engine: after the target's 1003, "1002 1003" went on with
    1004 1005 once and 1004 1009 once, so only 1004 is drafted; output unchanged."""
    first = [1000, 1001, 1002, 1003, 1004, 1005, 7]
    prompt = [*first, *first[:5], 1009, 9, *first[:3]]
    base = engine.settings
    steps = {}
    try:
        for agree in (False, True):
            spec = replace(base.spec, mode="ngram", ngram_agree=agree)
            engine.settings = replace(base, spec=spec)
            req = GenerationRequest(slot=0, prompt=prompt, n_predict=8, sampling=GREEDY)
            res = engine.generate(req)
            assert res.tokens == follow_chain(prompt[-1], 8)
            steps[agree] = res.spec_steps[0]
        # and with the draft model capped by its cost (the candidate default): still exact
        spec = replace(base.spec, ngram_agree=True, draft_cost_max=0.5)
        engine.settings = replace(base, spec=spec)
        assert engine.generate(req).tokens == follow_chain(prompt[-1], 8)
    finally:
        engine.settings = base
    assert steps[False] == ("ngram", 6, 1)  # the most recent occurrence: 1004 1009 9 ...
    assert steps[True] == ("ngram", 1, 1)


def test_weighed_sources_take_the_model_where_it_yields_more(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``weigh_sources``: where the cost model expects the draft model's draft to yield more
    than the n-gram draft on offer, the step takes the model's; without it the n-gram draft
    goes first whenever there is one. (The expected gains are pinned: measured ones depend on
    the machine.) The output stays the target's."""
    first = [1000, 1001, 1002, 1003, 1004, 1005, 7]
    prompt = [*first, *first[:5], 1009, 9, *first[:3]]  # the n-gram drafter has a match
    monkeypatch.setattr(SpecPolicy, "plan", lambda self, source, **kw: 4)
    monkeypatch.setattr(
        SpecPolicy, "gain", lambda self, source, k, extra_ms=0.0: 3.0 if source == "draft" else 1.5
    )
    base = engine.settings
    sources = {}
    try:
        for weigh in (False, True):
            engine.settings = replace(base, spec=replace(base.spec, weigh_sources=weigh))
            req = GenerationRequest(slot=0, prompt=prompt, n_predict=8, sampling=GREEDY)
            res = engine.generate(req)
            assert res.tokens == follow_chain(prompt[-1], 8)
            sources[weigh] = [src for src, _, _ in res.spec_steps]
    finally:
        engine.settings = base
    assert sources[False][0] == "ngram"
    assert sources[True] and set(sources[True]) == {"draft"}


CODE = '''def read_config(path):
    """Read a key = value file into a dict."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result


def write_config(path, values):
'''


def test_weighed_sources_and_learned_p_min_stay_exact(
    smollm_f32: Path, smollm_q4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The opt-in ``weigh_sources`` and ``learn_p_min`` on a real trained pair whose draft is
    its target quantized: the output stays the target's own, token for token. The draft is
    often unsure where the target then takes its token: with ``learn_p_min`` the engine
    drafts past such tokens and records how the target answered them, without it none is
    drafted. (For that part the lengths are pinned: how much a measured cost model lets the
    draft model draft depends on the machine; ``unsure_pays`` itself is tested in
    test_engine_pure.py.)"""
    settings = _settings(smollm_f32, smollm_q4)
    with Engine.load(settings) as eng:
        prompt = eng.vocab.tokenize(CODE)
        req = GenerationRequest(slot=0, prompt=prompt, n_predict=64, sampling=GREEDY)
        eng.settings = replace(settings, spec=replace(settings.spec, mode="off"))
        reference = eng.generate(req).tokens
        both = replace(settings.spec, weigh_sources=True, learn_p_min=True)
        eng.settings = replace(settings, spec=both)
        assert eng.generate(req).tokens == reference
        monkeypatch.setattr(SpecPolicy, "plan", lambda self, source, **kw: 6)
        monkeypatch.setattr(SpecPolicy, "unsure_pays", lambda self: True)
        model_only = replace(settings.spec, mode="draft", adaptive=True)
        for learn in (False, True):
            spec = replace(model_only, learn_p_min=learn)
            eng.settings = replace(settings, spec=spec)
            res = eng.generate(req)
            assert res.tokens == reference
            assert sum(d for src, d, _ in res.spec_steps if src == "draft") > 8
            unsure = eng.pair.policy_for(False, spec, 0.3).unsure
            if learn:
                assert len(unsure) > 0 and sum(unsure) > 0
            else:
                assert len(unsure) == 0

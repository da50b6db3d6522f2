"""llama-server's sampling fields beyond top_k/top_p/min_p/temperature, over real HTTP.

``smol`` serves SmolLM2-135M-Instruct (a trained model with a chat template, n-gram
speculation); ``pair`` the tiny Qwen-vocabulary target with its f16 copy as the draft model
(random weights: nonsense text, but a draft that proposes what the target would say unless
the grammar says otherwise). Every assertion is a property that holds whatever tokens a model
prefers on this CPU: an answer matches its grammar, a banned token never appears, penalised
tokens never repeat, speculation never changes an answer.
"""

# ruff: noqa: F811 (the tests take the imported SmolLM2 daemon fixtures by name)
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import llama_cpp
import llama_cpp.llama_cpp as C
import pytest

from localspec.engine.llama import Clock
from localspec.engine.sampling import GrammarError, Sampler, check_grammar
from localspec.engine.types import DEFAULT_SAMPLERS, SamplingParams, SpecSettings
from localspec.server import ServerSettings, create_app
from localspec.server.errors import InvalidRequest
from localspec.server.requests import (
    CompletionRequest,
    logit_biases,
    sampling_params,
    schema_grammar,
)
from tests.test_server_chat import sc, smol  # noqa: F401 (the SmolLM2 daemon's fixtures)
from tests.test_server_http import N_CTX, Live, engine_settings, start, stop

GREEDY = {"temperature": 0, "top_k": 1}
YES_NO = 'root ::= "yes" | "no"'
WORDS = 'root ::= [a-z]+ (" " [a-z]+){3,8} "."'
# what WORDS allows, cut anywhere by n_predict
WORDS_PREFIX = r"[a-z]+( [a-z]+){0,8}( |\.)?"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}
ASK = "Question: is the sky blue? Answer in JSON.\n"


@pytest.fixture(scope="module")
def pair(qwen_target: Path, qwen_target_f16: Path) -> Iterator[Live]:
    es = engine_settings(qwen_target, qwen_target_f16, n_slots=1)
    es = replace(es, spec=SpecSettings(mode="draft", n_max=8, p_min=0.0))
    live = start(create_app(ServerSettings(port=0), es))
    yield live
    stop(live)


@pytest.fixture
def pc(pair: Live) -> Iterator[httpx.Client]:
    with pair.client() as c:
        yield c


def complete(c: httpx.Client, body: dict[str, Any], route: str = "/completion") -> dict[str, Any]:
    r = c.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(c: httpx.Client, body: dict[str, Any], route: str = "/completion") -> str:
    """The 400's message, checked to be in llama-server's error format."""
    r = c.post(route, json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    return str(err["message"])


def check_schema(value: Any) -> None:
    assert isinstance(value, dict) and set(value) == {"answer", "sure"}, value
    assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)


# ---------------------------------------------------------------- grammars and JSON schemas


def test_grammar_answer_is_one_of_its_words(sc: httpx.Client) -> None:
    for seed in (1, 2, 3):  # sampled (default temperature): still only what the grammar allows
        body = {"prompt": "Is water wet?", "grammar": YES_NO, "n_predict": 8, "seed": seed}
        a = complete(sc, body)
        assert a["content"] in ("yes", "no") and a["stop_type"] == "eos"
    a = complete(sc, {"prompt": "Is water wet?", "grammar": YES_NO, "max_tokens": 8},
                 route="/v1/completions")  # fmt: skip
    assert a["choices"][0]["text"] in ("yes", "no")


def test_grammar_holds_for_every_completion_of_a_batch(sc: httpx.Client) -> None:
    """n_cmpl: each sequence of the batch draws with its own grammar."""
    body = {"prompt": "Is fire cold?", "grammar": WORDS, "n_predict": 24, "n_cmpl": 2,
            "seed": 7, "temperature": 1.5}  # fmt: skip
    answers = complete(sc, body)
    assert isinstance(answers, list) and len(answers) == 2
    for a in answers:
        assert re.fullmatch(WORDS_PREFIX, a["content"]), a["content"]


def test_json_schema_answer_validates(sc: httpx.Client) -> None:
    a = complete(sc, {"prompt": ASK, "json_schema": SCHEMA, "n_predict": 48, **GREEDY})
    assert a["stop_type"] == "eos"
    check_schema(json.loads(a["content"]))
    # a grammar given too wins (llama-server's rule)
    both = complete(sc, {"prompt": ASK, "json_schema": SCHEMA, "grammar": YES_NO, "n_predict": 8})
    assert both["content"] in ("yes", "no")


def test_chat_response_format_constrains_the_answer(sc: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    base = {"messages": messages, "max_tokens": 48, **GREEDY}  # the schema needs <= 37
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        {"type": "json_object", "schema": SCHEMA},
    ):
        r = sc.post("/v1/chat/completions", json={**base, "response_format": fmt})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        check_schema(json.loads(choice["message"]["content"]))
    # any object: an answer that ends is one; one cut short is the start of one
    r = sc.post("/v1/chat/completions", json={**base, "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    r = sc.post("/v1/chat/completions", json={**base, "grammar": YES_NO, "max_tokens": 8})
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_grammar_answer_is_the_same_with_and_without_speculation(pc: httpx.Client) -> None:
    """The draft model proposes the target's unconstrained choice; drafted tokens the grammar
    refuses are simply not drawn, so the answer is the one without drafts (greedy and seeded)."""
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    for sampling in (GREEDY, {"temperature": 0.9, "seed": 11}):
        body = {"prompt": prompt, "grammar": WORDS, "n_predict": 32, "cache_prompt": False,
                "speculative.p_min": 0.0, **sampling}  # fmt: skip
        plain = complete(pc, {**body, "speculative.n_max": 0})
        spec = complete(pc, body)
        assert plain["timings"]["draft_n"] == 0 < spec["timings"]["draft_n"]
        assert spec["tokens"] == plain["tokens"] and spec["content"] == plain["content"]
        assert re.fullmatch(WORDS_PREFIX, spec["content"]), spec["content"]


def test_grammar_on_infill(pc: httpx.Client) -> None:
    body = {"input_prefix": "x = ", "input_suffix": "\n", "grammar": YES_NO, "n_predict": 8}
    assert complete(pc, body, route="/infill")["content"] in ("yes", "no")


# ---------------------------------------------------------------- biases and penalties


def test_logit_bias_ban_changes_the_first_token(sc: httpx.Client) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 6, "cache_prompt": False,
            **GREEDY}  # fmt: skip
    plain = complete(sc, body)["tokens"]
    first = plain[0]
    for bias in ([[first, False]], {str(first): False}, [[first, -1e9]]):
        banned = complete(sc, {**body, "logit_bias": bias})["tokens"]
        assert banned and banned[0] != first and first not in banned, bias
    # a text is each of its tokens (tokenized without special tokens)
    piece = sc.post("/detokenize", json={"tokens": [first]}).json()["content"]
    ids = sc.post("/tokenize", json={"content": piece, "parse_special": False}).json()["tokens"]
    by_text = complete(sc, {**body, "logit_bias": [[piece, False]]})["tokens"]
    assert not set(ids) & set(by_text)


def test_penalties_see_the_prompt_and_every_emitted_token(sc: httpx.Client) -> None:
    prompt = "1, 2, 3, 4, 5, 6, 7,"
    body = {"prompt": prompt, "n_predict": 16, "cache_prompt": False, **GREEDY}
    ids = set(sc.post("/tokenize", json={"content": prompt}).json()["tokens"])
    plain = complete(sc, body)["tokens"]
    assert set(plain) & ids or len(set(plain)) < len(plain)  # it repeats without penalties
    penalised = {**body, "repeat_last_n": -1, "presence_penalty": 1000.0,
                 "frequency_penalty": 1.0, "repeat_penalty": 2.0}  # fmt: skip
    tokens = complete(sc, penalised)["tokens"]
    assert len(set(tokens)) == len(tokens) and not set(tokens) & ids
    # the same fields through chat's sampler
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, **GREEDY}
    a = sc.post("/v1/chat/completions", json={**chat, **penalised, "n_predict": 12}).json()
    assert a["usage"]["completion_tokens"] >= 1


def test_ignore_eos_decodes_to_n_predict(smol: Live, sc: httpx.Client) -> None:
    """An end token pushed to the top ends the answer at once; ignore_eos bans it anyway."""
    eog = sorted(smol.service.engine.vocab.eog)
    body = {"prompt": "Hello", "n_predict": 12, "logit_bias": [[t, 1000.0] for t in eog],
            **GREEDY}  # fmt: skip
    ended = complete(sc, body)
    assert ended["stop_type"] == "eos" and ended["tokens_predicted"] <= 1
    a = complete(sc, {**body, "ignore_eos": True})
    assert a["stop_type"] == "limit" and a["tokens_predicted"] == 12
    assert not set(a["tokens"]) & set(eog)


def test_other_samplers_run_and_are_deterministic_per_seed(sc: httpx.Client) -> None:
    """DRY, typical, XTC, top-n-sigma, dynamic temperature, Mirostat 1 and 2: a seeded request
    repeats its answer, and greedy with DRY at a huge multiplier never repeats a token run."""
    body = {"prompt": "Once upon a time", "n_predict": 10, "seed": 5, "cache_prompt": False}
    variants = [
        {"dry_multiplier": 0.8, "dry_penalty_last_n": -1, "typical_p": 0.9},
        {"xtc_probability": 0.5, "xtc_threshold": 0.1, "top_n_sigma": 1.5, "min_keep": 2},
        {"dynatemp_range": 0.5, "dynatemp_exponent": 2.0},
        {"mirostat": 1, "mirostat_tau": 4.0, "mirostat_eta": 0.2},
        {"mirostat": 2},
    ]
    for extra in variants:
        one = complete(sc, {**body, **extra})
        two = complete(sc, {**body, **extra})
        assert one["tokens"] == two["tokens"] and one["tokens_predicted"] >= 1, extra


# ---------------------------------------------------------------- refusals and the echo


def test_bad_values_are_400s_and_the_daemon_goes_on(sc: httpx.Client) -> None:
    base = {"prompt": "a", "n_predict": 2}
    assert "grammar" in refused(sc, {**base, "grammar": "root ::= ("})
    assert "grammar" in refused(sc, {**base, "grammar": 'start ::= "a"'})  # no root
    assert "grammar" in refused(sc, {**base, "grammar": "root ::= root"})  # left recursion
    assert "json_schema" in refused(sc, {**base, "json_schema": {"type": "nonsense"}})
    assert "json_schema" in refused(sc, {**base, "json_schema": [1]})
    for bias in ("x", 5, [[1]], [[1, "a"]], [[1, True]], [[-1, 1.0]], [[10**7, 1.0]],
                 [[[1], 1.0]], {"1": "a"}):  # fmt: skip
        assert "logit_bias" in refused(sc, {**base, "logit_bias": bias}), bias
    assert "repeat_penalty" in refused(sc, {**base, "repeat_penalty": 0})
    assert "dry_sequence_breakers" in refused(sc, {**base, "dry_sequence_breakers": []})
    assert "repeat_last_n" in refused(sc, {**base, "repeat_last_n": -2})
    msg = [{"role": "user", "content": "hi"}]
    chat = "/v1/chat/completions"
    both = {"messages": msg, "grammar": YES_NO, "json_schema": SCHEMA}
    assert "both" in refused(sc, both, route=chat)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert "tools" in refused(sc, {"messages": msg, "grammar": YES_NO, "tools": tools}, chat)
    assert "grammar" in refused(sc, {"messages": msg, "grammar": "root ::= ("}, route=chat)
    bad_fmt = {"messages": msg, "response_format": {"type": "xml"}}
    assert "response_format" in refused(sc, bad_fmt, route=chat)
    # nothing was queued for those; the daemon answers the next request
    assert complete(sc, {**base, "grammar": YES_NO, "n_predict": 8})["content"] in ("yes", "no")


def test_generation_settings_echo_the_fields(sc: httpx.Client) -> None:
    body = {"prompt": "a", "n_predict": 1, "repeat_penalty": 1.1, "repeat_last_n": -1,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "dry_multiplier": 0.8,
            "dry_base": 0.5, "dry_penalty_last_n": 32, "typical_p": 0.9, "mirostat": 7,
            "xtc_probability": 2.0, "top_n_sigma": 1.0, "min_keep": 3, "grammar": YES_NO,
            "logit_bias": {"5": False, "6": 2}, "ignore_eos": True}  # fmt: skip
    gs = complete(sc, body)["generation_settings"]
    assert gs["repeat_penalty"] == pytest.approx(1.1) and gs["repeat_last_n"] == N_CTX
    assert gs["presence_penalty"] == 0.5 and gs["frequency_penalty"] == 0.25
    assert gs["dry_multiplier"] == pytest.approx(0.8) and gs["dry_base"] == 1.75  # < 1: default
    assert gs["dry_penalty_last_n"] == 32 and gs["dry_sequence_breakers"] == ["\n", ":", '"', "*"]
    assert gs["typical_p"] == pytest.approx(0.9) and gs["mirostat"] == 2  # clamped
    assert gs["xtc_probability"] == 1.0 and gs["top_n_sigma"] == 1.0 and gs["min_keep"] == 3
    assert gs["grammar"] == YES_NO and gs["ignore_eos"] is True
    assert gs["logit_bias"][:2] == [{"bias": None, "token": 5}, {"bias": 2.0, "token": 6}]
    assert len(gs["logit_bias"]) > 2  # the end tokens ignore_eos bans
    assert gs["samplers"] == list(DEFAULT_SAMPLERS)
    props = sc.get("/props").json()["default_generation_settings"]["params"]
    assert props["samplers"] == list(DEFAULT_SAMPLERS) and props["repeat_penalty"] == 1.0
    assert props["repeat_last_n"] == 64 and props["logit_bias"] == [] and props["grammar"] == ""


# ---------------------------------------------------------------- units


@pytest.fixture(scope="module")
def vocab(smollm_q4: Path) -> Any:
    from localspec.engine.vocab import Vocab

    llm = llama_cpp.Llama(str(smollm_q4), vocab_only=True, verbose=False)
    v = Vocab(llm._model.vocab)
    v.keep = llm  # the model owns the vocabulary
    return v


def chain_names(params: SamplingParams, vocab: Any) -> list[str]:
    ctx = SimpleNamespace(clock=Clock())
    s = Sampler(params, ctx, vocab.handle)  # type: ignore[arg-type]
    try:
        n = C.llama_sampler_chain_n(s.chain)
        return [C.llama_sampler_name(C.llama_sampler_chain_get(s.chain, i)).decode()
                for i in range(n)]  # fmt: skip
    finally:
        s.close()


def test_chains_are_llama_servers(vocab: Any) -> None:
    """common_sampler_init's chain: biases first, the named samplers that do something at
    their values, then the draw; Mirostat replaces the chain; a plain greedy request is argmax,
    a greedy one with penalties or biases applies them before its argmax."""
    assert chain_names(SamplingParams(), vocab) == ["top-k", "top-p", "min-p", "temp-ext", "dist"]
    assert chain_names(SamplingParams(temperature=0), vocab) == ["greedy"]
    every = SamplingParams(
        repeat_penalty=1.2, dry_multiplier=0.5, top_n_sigma=1.0, typ_p=0.9,
        xtc_probability=0.3, logit_bias=((1, -math.inf),), temperature=0,
    )  # fmt: skip
    assert chain_names(every, vocab) == [
        "logit-bias", "penalties", "dry", "top-n-sigma", "top-k", "typical", "top-p",
        "min-p", "xtc", "temp-ext", "dist",
    ]  # fmt: skip
    miro = SamplingParams(mirostat=2, logit_bias=((1, 2.0),))
    assert chain_names(miro, vocab) == ["logit-bias", "temp", "mirostat-v2"]
    assert chain_names(replace(miro, mirostat=1), vocab)[-1] == "mirostat"
    assert SamplingParams(temperature=0).plain
    assert not SamplingParams(temperature=0, grammar=YES_NO).plain
    assert SamplingParams(repeat_penalty=1.5, samplers=("top_k",)).plain  # not in the chain


def test_grammar_check_and_schema_conversion(vocab: Any) -> None:
    check_grammar(vocab.handle, YES_NO)
    for bad in ("root ::= (", 'x ::= "a"', "root ::= root", "root ::= \0"):
        with pytest.raises(GrammarError):
            check_grammar(vocab.handle, bad)
    check_grammar(vocab.handle, schema_grammar(SCHEMA))
    check_grammar(vocab.handle, schema_grammar({}))  # any object
    with pytest.raises(InvalidRequest, match="json_schema"):
        schema_grammar({"type": "nonsense"})


def test_logit_bias_forms(vocab: Any) -> None:
    assert logit_biases([[5, 1.5], [6, False]], vocab) == ((5, 1.5), (6, -math.inf))
    assert logit_biases({"5": -2, " 7": 1}, vocab) == ((5, -2.0), (7, 1.0))
    hello = vocab.tokenize("Hello world")
    assert logit_biases([["Hello world", 3]], vocab) == tuple((t, 3.0) for t in hello)
    assert logit_biases({"Hello world": False}, vocab) == tuple((t, -math.inf) for t in hello)
    for bad in ([[5]], [[5, None]], [[True, 1]], {"5": [1]}, "5", [[vocab.n_vocab, 1]]):
        with pytest.raises(InvalidRequest, match="logit_bias"):
            logit_biases(bad, vocab)


def test_sampling_params_follow_llama_servers_limits(vocab: Any) -> None:
    def parse(**fields: Any) -> SamplingParams:
        body = CompletionRequest.model_validate({"prompt": "a", **fields})
        return sampling_params(body, SamplingParams(), n_ctx=512, vocab=vocab)

    assert parse() == SamplingParams()
    p = parse(repeat_last_n=-1, dry_penalty_last_n=-1, xtc_threshold=-1, mirostat=-3)
    assert (p.repeat_last_n, p.dry_penalty_last_n, p.xtc_threshold, p.mirostat) == (512, 512, 0, 0)
    assert parse(dry_base=0.9).dry_base == 1.75 and parse(dry_base=2).dry_base == 2.0
    eos = parse(ignore_eos=True, logit_bias=[[5, 1]]).logit_bias
    assert eos[0] == (5, 1.0) and {t for t, _ in eos[1:]} == set(vocab.eog)
    with pytest.raises(InvalidRequest, match="repeat_penalty"):
        parse(repeat_penalty=-1)
    with pytest.raises(InvalidRequest, match="grammar"):
        parse(grammar="root ::= (")
    assert hash(parse(logit_bias={"5": False}, grammar=YES_NO))  # cached by value


def test_parameter_sets_with_nested_json_are_cached_by_value() -> None:
    """A logit_bias or json_schema body is remembered like any other (one parse per distinct
    set); a schema's property order is part of the key (it orders the grammar's rules)."""
    from localspec.server.state import _params_key

    def key(**fields: Any) -> Any:
        return _params_key(CompletionRequest.model_validate({"prompt": "a", **fields}))

    bias = key(logit_bias=[[5, False], ["x", 1]], json_schema=SCHEMA)
    assert hash(bias) and bias == key(logit_bias=[[5, False], ["x", 1]], json_schema=SCHEMA)
    props = SCHEMA["properties"]
    flipped = {**SCHEMA, "properties": {"sure": props["sure"], "answer": props["answer"]}}
    assert key(json_schema=SCHEMA) != key(json_schema=flipped)
    assert key(logit_bias={"5": False}) != key(logit_bias={"5": -1})

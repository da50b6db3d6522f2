"""Pure pieces of the server: answer shapes, response_fields, parameter parsing, slot choice."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from localspec.engine.cache_plan import choose_slot, common_prefix
from localspec.engine.types import (
    DraftStats,
    GenerationResult,
    PromptLayout,
    SamplingParams,
    TokenProbs,
)
from localspec.server.errors import InvalidRequest
from localspec.server.gate import key_matches, presented_key
from localspec.server.options import ServerSettings
from localspec.server.requests import RANDOM_SEED, InfillRequest, sampler_chain, task_params
from localspec.server.results import (
    LOWEST_LOGPROB,
    Completion,
    SlotInfo,
    completion_probabilities,
    dumps,
    final_object,
    pick_fields,
    timings,
)


def test_compact_json_has_no_spaces_and_keeps_utf8() -> None:
    raw = dumps({"content": "é x", "n": [1, 2]})
    assert raw == '{"content":"é x","n":[1,2]}'.encode()


def test_response_fields_flatten_paths_and_skip_missing() -> None:
    obj = {"content": "x", "timings": {"prompt_n": 3}, "generation_settings": {"n_ctx": 8}}
    got = pick_fields(["content", "timings/prompt_n", "generation_settings/n_ctx", "nope/x"], obj)
    assert got == {"content": "x", "timings/prompt_n": 3, "generation_settings/n_ctx": 8}
    assert pick_fields([""], obj) == {}


def _result(**kw: object) -> GenerationResult:
    base: dict[str, object] = {"tokens": [5, 6], "text": "a\nb", "stop_type": "eos"}
    base.update(kw)
    return GenerationResult(**base)  # type: ignore[arg-type]


def test_final_object_has_every_llama_server_field() -> None:
    result = _result(n_prompt=10, n_cached=7, n_evaluated=3, prompt_ms=6.0, predicted_ms=4.0)
    result.drafted["ngram"] = DraftStats(drafted=4, accepted=3)
    obj = final_object(
        Completion(result, index=0, id_slot=1, tokens_cached=12, prompt_text="p"),
        model="m.gguf",
        settings_json={"n_ctx": 4096},
    )
    assert list(obj) == [
        "index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted",
        "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated",
        "stop_type", "stopping_word", "tokens_cached", "timings",
    ]  # fmt: skip
    assert obj["has_new_line"] is True and obj["tokens_evaluated"] == 10
    assert obj["generation_settings"]["n_ctx"] == 4096
    t = obj["timings"]
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (7, 3, 2)
    assert t["prompt_per_token_ms"] == 2.0 and t["predicted_per_second"] == 500.0
    assert (t["draft_n"], t["draft_n_accepted"]) == (4, 3)


def test_timings_never_divide_by_zero() -> None:
    t = timings(_result(tokens=[], text=""))
    assert t["prompt_per_second"] == 0.0 and t["predicted_per_token_ms"] == 0.0
    json.loads(dumps(t))


def test_infill_body_accepts_llama_vscode_fields_and_ignores_unknown() -> None:
    body = InfillRequest.model_validate(
        {
            "id_slot": 0, "input_prefix": "a", "input_suffix": "b",
            "input_extra": [{"text": "t", "time": 1724000000, "filename": "/x.ts"}],
            "prompt": "", "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "n_indent": 4, "t_max_prompt_ms": 500, "t_max_predict_ms": 500, "model": "x",
            "lora": [{"id": 0, "scale": 1}], "speculative.n_max": 8, "brand_new_field": 1,
        }
    )  # fmt: skip
    params = task_params(body, n_ctx=4096, n_cmpl_max=16)
    req = params.request
    assert (req.n_predict, req.n_indent, req.t_max_predict_ms, req.spec_n_max) == (128, 4, 500, 8)
    assert req.sampling.samplers == ("top_k", "top_p", "infill")
    assert (params.n_cmpl, params.id_slot) == (3, 0)
    assert body.input_extra is not None and body.input_extra[0].filename == "/x.ts"


def test_nulls_mean_defaults_and_soft_limits_clamp() -> None:
    body = InfillRequest.model_validate(
        {"input_prefix": "", "input_suffix": "", "n_predict": None, "top_p": 7, "top_k": -3,
         "temperature": -1, "seed": -1, "stop": ["", "\n\n"]}
    )  # fmt: skip
    params = task_params(body, n_ctx=512, n_cmpl_max=16, default_sampling=SamplingParams())
    s = params.request.sampling
    assert (s.top_p, s.top_k, s.temperature, s.seed) == (1.0, 0, 0.0, RANDOM_SEED)
    assert params.request.n_predict == -1 and params.request.stop == ("\n\n",)


def test_hard_limits_reject() -> None:
    with pytest.raises(ValidationError):
        InfillRequest.model_validate({"input_prefix": "", "input_suffix": "", "n_predict": -2})
    with pytest.raises(ValidationError):
        InfillRequest.model_validate({"input_prefix": ""})  # input_suffix is required
    body = InfillRequest.model_validate({"input_prefix": "", "input_suffix": "", "n_cmpl": 99})
    with pytest.raises(InvalidRequest, match="n_cmpl"):
        task_params(body, n_ctx=512, n_cmpl_max=16)


def test_n_cmpl_seeds_are_distinct() -> None:
    body = InfillRequest.model_validate(
        {"input_prefix": "", "input_suffix": "", "n_cmpl": 3, "seed": 42}
    )
    params = task_params(body, n_ctx=512, n_cmpl_max=16)
    assert params.seeds() == [42, 43, 44]
    random_params = task_params(
        InfillRequest.model_validate({"input_prefix": "", "input_suffix": "", "n": 4}),
        n_ctx=512,
        n_cmpl_max=16,
    )
    assert len(set(random_params.seeds())) == 4
    reqs = [random_params.request_for(i, [7, 8, 9, 10], 0, PromptLayout([1])) for i in range(4)]
    assert [r.sampling.seed for r in reqs] == [7, 8, 9, 10]


def test_sampler_names_and_chars() -> None:
    assert sampler_chain(["top-k", "nucleus", "temp", "infill"]) == (
        "top_k", "top_p", "temperature", "infill",
    )  # fmt: skip
    assert sampler_chain("kpi") == ("top_k", "top_p", "infill")
    # unlike llama-server (which skips them silently), an unknown sampler is a clear 400
    with pytest.raises(InvalidRequest, match="bogus"):
        sampler_chain(["top_k", "bogus"])
    with pytest.raises(InvalidRequest, match="'z'"):
        sampler_chain("kz")
    # one table with the engine's, llama.cpp's: what passes here, the engine builds
    assert sampler_chain(["topk", "min-p", "adaptive_p"]) == ("top_k", "min_p", "adaptive_p")
    assert sampler_chain("a") == ("adaptive_p",)
    with pytest.raises(InvalidRequest, match="typical"):  # not one of llama.cpp's spellings
        sampler_chain(["typical"])


def test_common_prefix_across_chunk_boundaries() -> None:
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    b = [*a[:700], -1, *a[701:]]
    assert common_prefix(a, b) == 700
    assert common_prefix(a, a[:300]) == 300 and common_prefix([], a) == 0


def test_slot_choice_prefers_longest_prefix_then_least_recent() -> None:
    slots = [
        SlotInfo(0, 512, [1, 2, 3], last_used=5.0),
        SlotInfo(1, 512, [1, 2, 9, 9], last_used=1.0),
        SlotInfo(2, 512, [], last_used=0.0),
    ]
    assert choose_slot([1, 2, 3, 4], slots) == 0
    assert choose_slot([7, 7], slots) == 2  # nothing shared: the never-used slot
    assert choose_slot([1, 2, 3], slots, id_slot=1) == 1
    assert choose_slot([1], slots, id_slot=4) == 1  # ids wrap around, as in llama-server
    slots[0].is_processing = True
    assert choose_slot([1, 2, 3, 4], slots) == 1


def test_api_key_forms() -> None:
    assert presented_key("Bearer abc", None) == "abc"
    assert presented_key(None, "abc") == "abc"
    assert key_matches("abc", "abc") and not key_matches("abd", "abc")


def test_non_loopback_bind_needs_a_key() -> None:
    with pytest.raises(ValueError, match="API key"):
        ServerSettings(host="0.0.0.0").check()
    ServerSettings(host="0.0.0.0", api_key="k").check()
    ServerSettings().check()


class CountingVocab:
    """A vocabulary stand-in that counts tokenizer calls (the cache's only collaborator)."""

    def __init__(self) -> None:
        self.calls = 0

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        self.calls += 1
        return [ord(c) + (1000 if special else 0) for c in text]

    def piece(self, token: int, *, special: bool = False) -> bytes:
        return chr(token % 1000).encode()


def test_token_cache_is_exact_and_bounded() -> None:
    from localspec.server.prompts import TokenCache

    vocab = CountingVocab()
    cache = TokenCache(max_tokens=10, max_texts=3)
    assert cache.tokenize(vocab, "abc", special=False) == [97, 98, 99]
    assert cache.tokenize(vocab, "abc", special=False) == [97, 98, 99]
    assert vocab.calls == 1  # the second one came from the cache
    assert cache.tokenize(vocab, "abc", special=True) == [1097, 1098, 1099]  # its own key
    cache.tokenize(vocab, "defgh", special=False)  # 3 + 3 + 5 > 10: the oldest goes
    cache.tokenize(vocab, "abc", special=False)
    assert vocab.calls == 4


def test_token_cache_detokenizes_blocks_like_the_vocab() -> None:
    from localspec.server.prompts import BLOCK, TokenCache

    vocab = CountingVocab()
    cache = TokenCache()
    tokens = [ord("a") + i % 26 for i in range(BLOCK * 2 + 7)]
    want = "".join(chr(t) for t in tokens)
    assert cache.detokenize(vocab, tokens) == want
    assert cache.detokenize(vocab, tokens[:-1]) == want[:-1]  # cached blocks, new tail


def test_completion_probabilities_in_llama_server_shape() -> None:
    """Text without a token's incomplete UTF-8 tail, the raw bytes, log(0) as the lowest
    float (JSON has no -inf); the final answer carries them unless they were streamed."""
    pieces = {1: "é".encode()[:1], 2: b"ok", 3: b""}
    report = completion_probabilities(
        [1, 2], [TokenProbs(0.5, ((1, 0.5), (3, 0.0))), TokenProbs(1.0, ((2, 1.0),))],
        pieces.__getitem__,
    )  # fmt: skip
    first = report[0]
    assert (first["id"], first["token"], first["bytes"]) == (1, "", [0xC3])
    assert first["logprob"] == pytest.approx(-0.6931, abs=1e-4)
    assert first["top_logprobs"][1] == {
        "id": 3,
        "token": "",
        "bytes": [],
        "logprob": LOWEST_LOGPROB,
    }
    assert report[1]["token"] == "ok" and report[1]["logprob"] == 0.0
    result = GenerationResult(tokens=[1, 2], text="ok", stop_type="limit")
    result.probs = [TokenProbs(0.5, ((1, 0.5),)), TokenProbs(1.0, ((2, 1.0),))]
    done = Completion(result, 0, 0, 0)
    whole = final_object(done, model="m", settings_json={}, piece=pieces.__getitem__)
    assert len(whole["completion_probabilities"]) == 2
    streamed = final_object(
        done, model="m", settings_json={}, stream=True, piece=pieces.__getitem__
    )
    assert "completion_probabilities" not in streamed

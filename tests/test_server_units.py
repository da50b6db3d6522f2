"""Pure pieces of the server: answer shapes, response_fields, parameter parsing, slot choice."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from localspec.engine.cache import SeqState
from localspec.engine.cache_plan import (
    SlotChoice,
    cache_fit,
    cache_pieces,
    choose_slot,
    common_prefix,
)
from localspec.engine.slot import Slot, Task
from localspec.engine.types import (
    DraftStats,
    GenerationRequest,
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
    FinishedCompletion,
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
        FinishedCompletion(result, index=0, id_slot=1, tokens_cached=12, prompt_text="p"),
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


def _slot(i: int, last_used: float = 0.0) -> Slot:
    return Slot(i, 4096, SeqState(i), None, last_used=last_used)


def _busy(slot: Slot, prompt: Sequence[int] = (), *, warm_up: bool = False) -> None:
    """A request (``prompt``; a warm-up: n_predict 0) runs on ``slot``, instead of any before."""
    slot.queued.clear()
    req = GenerationRequest(slot=slot.id, prompt=list(prompt), n_predict=0 if warm_up else 16)
    slot.submitted(Task([req]))


def _editor(seed: int, n: int = 400) -> list[int]:
    """An editor's prompt: its own ring of project code (tokens no other editor has)."""
    return [seed * 100_000 + i for i in range(n)]


def test_slot_choice_follows_the_cache_that_holds_the_prompt() -> None:
    """Two editors both pin slot 0: each still gets the slot that holds its own context."""
    a, b = _editor(1), _editor(2)
    slots = [_slot(0, last_used=5.0), _slot(1, last_used=1.0)]
    slots[0].hold([*a, 7, 7])
    slots[1].hold([*b, 8])
    assert choose_slot([*b, 9, 9], slots, id_slot=0, follow_pin=False) == SlotChoice(1)
    assert choose_slot([*a[:200], 5, *a[300:]], slots, 0, follow_pin=False) == SlotChoice(0)
    # llama-server's rule, where pins are followed: the pinned slot, waited for when busy
    assert choose_slot([*b, 9], slots, id_slot=0) == SlotChoice(0)
    assert choose_slot([*b, 9], slots, id_slot=3) == SlotChoice(1)  # ids wrap around
    # a client on its own pinned slot stays there while another holds a little more of it
    slots[1].hold(b[:300])
    slots[0].hold(b)
    assert choose_slot([*b, 9], slots, id_slot=1, follow_pin=False) == SlotChoice(1)
    assert choose_slot([*b, 9], slots, id_slot=0, follow_pin=False) == SlotChoice(0)
    slots[0].hold([*a, 7, 7])
    slots[1].hold([*b, 8])
    _busy(slots[0])
    assert choose_slot([*a, 1], slots, id_slot=0) == SlotChoice(0, wait=True)


def test_slot_choice_without_a_fit_takes_an_unused_slot_then_the_least_recent() -> None:
    slots = [_slot(i) for i in range(3)]
    # nothing cached anywhere (N clients that each pin their own slot): the pin breaks the tie
    assert choose_slot(_editor(1), slots, id_slot=2, follow_pin=False) == SlotChoice(2)
    slots[0].hold(_editor(1))
    slots[0].last_used = 5.0
    slots[1].hold(_editor(2))
    slots[1].last_used = 1.0
    assert choose_slot(_editor(3), slots, id_slot=0, follow_pin=False) == SlotChoice(2)
    slots[2].hold(_editor(4))
    slots[2].last_used = 9.0
    assert choose_slot(_editor(3), slots, id_slot=0, follow_pin=False) == SlotChoice(1)
    # a shared header of a few pieces is not a fit
    assert choose_slot([*_editor(1)[:32], *_editor(3)], slots, 0, follow_pin=False).slot == 1
    # but a short prompt (a chat's) held whole is
    slots[1].hold(_editor(5, 40))
    slots[1].last_used = 20.0
    assert choose_slot([*_editor(5, 40), 1], slots, 0, follow_pin=False).slot == 1


def test_slot_choice_waits_for_a_busy_slot_only_when_it_holds_much_more() -> None:
    a = _editor(1, 1200)
    slots = [_slot(0), _slot(1)]
    slots[0].hold(a)
    _busy(slots[0])  # the same editor's previous keystroke, about to stop
    assert choose_slot([*a, 3], slots, follow_pin=False) == SlotChoice(0, wait=True)
    slots[1].hold(a[:1000])  # the idle one holds nearly as much: no reason to wait
    assert choose_slot([*a, 3], slots, follow_pin=False) == SlotChoice(1)
    # a teammate's busy slot with the same code in another order: the idle slot, at once
    slots[0].hold([*a[600:], *a[:600]])
    slots[1].hold([])
    assert choose_slot([*a, 3], slots, follow_pin=False) == SlotChoice(1)
    _busy(slots[1])
    assert choose_slot(_editor(2), slots, follow_pin=False).wait
    # the editor's first warm-up, still filling an empty slot: the prompt it runs counts
    slots = [_slot(0), _slot(1, last_used=1.0)]
    slots[1].hold(_editor(2))  # another editor's context, idle
    _busy(slots[0], a[:1000])
    assert choose_slot([*a, 3], slots, follow_pin=False) == SlotChoice(0, wait=True)
    _busy(slots[0], _editor(3))  # another editor's request runs there: take the idle slot
    assert choose_slot([*a, 3], slots, follow_pin=False) == SlotChoice(1)
    # the slot still holds this prompt, but another client's completion runs there and will
    # replace it: waiting would buy nothing (four clients on any slot waited seconds)
    slots[0].hold(a)
    assert choose_slot([*a, 3], slots, follow_pin=False) == SlotChoice(1)
    # a warm-up running there instead: a completion stops it, and the slot keeps its cache
    _busy(slots[0], _editor(3), warm_up=True)
    assert choose_slot([*a, 3], slots, follow_pin=False) == SlotChoice(0, wait=True)

    # the editor's ring moved on by a chunk (the oldest left the front): no prefix in common
    # with its busy slot, but its pieces are all there; a warm-up waits for that slot rather
    # than evict the other editor's context from the idle one (a completion does not wait)
    ring = _editor(1, 1200)
    slots = [_slot(0), _slot(1, last_used=1.0)]
    slots[0].hold([*ring, *_editor(4, 300)])
    slots[1].hold(_editor(2))
    _busy(slots[0], [*ring, *_editor(4, 302)])
    moved = [*ring[100:], *_editor(5, 100)]
    assert choose_slot(moved, slots, follow_pin=False, patient=True) == SlotChoice(0, wait=True)
    assert choose_slot(moved, slots, follow_pin=False) == SlotChoice(1)


def test_cache_fit_counts_pieces_found_anywhere() -> None:
    ring, code = _editor(1, 640), _editor(2, 320)
    pieces = cache_pieces([*ring, *code])
    rotated = [*ring[320:], *_editor(3, 64), *code]  # the ring moved on: its rest is found
    assert 560 <= cache_fit(rotated, pieces) <= 640
    assert cache_fit(_editor(4), pieces) == 0


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
    done = FinishedCompletion(result, 0, 0, 0)
    whole = final_object(done, model="m", settings_json={}, piece=pieces.__getitem__)
    assert len(whole["completion_probabilities"]) == 2
    streamed = final_object(
        done, model="m", settings_json={}, stream=True, piece=pieces.__getitem__
    )
    assert "completion_probabilities" not in streamed

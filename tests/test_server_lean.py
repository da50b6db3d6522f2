"""The request path around the engine, with a fake one (no model, in-process): bodies validated
from the raw bytes, routes served past FastAPI's router, answers as compact JSON, and the
bookkeeping (metrics, the log line) done once the answer is out."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response
from starlette.testclient import TestClient

from localspec.engine.types import EngineSettings, GenerationResult, ModelSettings
from localspec.server import ServerSettings, create_app, logs
from localspec.server.errors import InvalidRequest
from localspec.server.gate import LeanRoute
from localspec.server.prompts import TokenCache
from localspec.server.requests import (
    CompletionRequest,
    InfillRequest,
    OpenAICompletionRequest,
    TokenizeRequest,
    parse_body,
)
from localspec.server.results import dumps
from tests.fake_engine import FakeVocab, StepEngine


class FakeEngine(StepEngine):
    n_ctx = 4096
    n_batch = 512

    def run(self, req: Any, **_: Any) -> GenerationResult:
        self.slots[req.slot].target.tokens = [*req.prompt, 7, 8]
        return GenerationResult(
            tokens=[7, 8], text='é "x",', stop_type="limit", n_prompt=len(req.prompt),
            n_evaluated=len(req.prompt), prompt_ms=1.0, predicted_ms=1.0,
        )  # fmt: skip


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = create_app(
        ServerSettings(port=0), EngineSettings(target=ModelSettings(path="fake.gguf")),
        load=FakeEngine,
    )  # fmt: skip
    with TestClient(app, raise_server_exceptions=False) as c:
        worker = app.state.service.worker
        deadline = time.monotonic() + 30
        while worker.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.state == "ready"
        yield c


INFILL = {"input_prefix": "def f(", "input_suffix": ")\n", "prompt": "x", "n_predict": 2,
          "input_extra": [{"text": "import os\n", "filename": "a.py"}]}  # fmt: skip


def test_answers_are_compact_json_with_the_timing_header(client: TestClient) -> None:
    for extra in ({}, {"response_fields": ["content", "timings/prompt_n"]}):
        r = client.post("/infill", content=json.dumps({**INFILL, **extra}))
        assert r.status_code == 200, r.text
        assert r.content == dumps(r.json())  # no space after ':' or ','
        assert b'"content":"\xc3\xa9 \\"x\\","' in r.content  # llama.vim's regex, UTF-8 as is
        assert r.headers["server"].startswith("localspec/")
        assert "parse;dur=" in r.headers["server-timing"]
    assert r.json() == {"content": 'é "x",', "timings/prompt_n": r.json()["timings/prompt_n"]}


# what FastAPI's own body handling answered (json.loads, then validation): kept word for word
REFUSED = [
    (b'{"input_prefix": "a", ', "Invalid request: 22: JSON decode error"),
    (b"", "Invalid request: body: Field required"),
    (b"[1, 2]", "Invalid request: body: Input should be a valid dictionary or object to extract "
                "fields from"),
    (b"null", "Invalid request: body: Input should be a valid dictionary or object to extract "
              "fields from"),
    (b'{"input_prefix": "\xff", "input_suffix": ""}', "There was an error parsing the body"),
    (b'{"input_prefix": "a\tb", "input_suffix": ""}', "Invalid request: 19: JSON decode error"),
    (b'{"input_prefix": "a", "input_suffix": ""} x', "Invalid request: 42: JSON decode error"),
    (b'{"input_prefix": "a"}', "Invalid request: input_suffix: Field required"),
    (b'{"input_prefix": "", "input_suffix": "", "n_predict": ' + b"9" * 5000 + b"}",
     "There was an error parsing the body"),
    (b'{"input_prefix": "", "input_suffix": "", "input_extra": [{"text": 5}]}',
     "Invalid request: input_extra.0.text: Input should be a valid string"),
]  # fmt: skip


@pytest.mark.parametrize("raw,message", REFUSED)
def test_refused_bodies_keep_their_llama_server_errors(
    client: TestClient, raw: bytes, message: str
) -> None:
    r = client.post("/infill", content=raw)
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "message": message,
                                  "type": "invalid_request_error"}}  # fmt: skip


def test_lone_surrogates_are_refused_by_name(client: TestClient) -> None:
    r = client.post("/infill", content=b'{"input_prefix": "a\\ud800b", "input_suffix": ""}')
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]


def test_bodies_pythons_parser_takes_are_still_taken(client: TestClient) -> None:
    body = json.dumps(INFILL)
    for raw in (b"\xef\xbb\xbf" + body.encode(), body.encode("utf-16"), body.encode("utf-32")):
        r = client.post("/infill", content=raw, headers={"Content-Type": "text/plain"})
        assert r.status_code == 200, r.text


def _same(model: type[BaseModel], raw: bytes) -> None:
    fast = parse_body(model, raw)
    slow = model.model_validate(json.loads(raw))
    assert type(fast) is type(slow) and fast.model_dump() == slow.model_dump()


def test_parse_body_builds_what_json_loads_and_validation_built() -> None:
    from localspec.bench.corpus import stdlib_path
    from localspec.bench.overhead import editor_requests

    for body in editor_requests(stdlib_path("argparse.py"), 3, 4):
        _same(InfillRequest, json.dumps(body).encode())
    odd = [
        (CompletionRequest, b'{"prompt": [1.0, "a", 2], "n_predict": "7", "seed": 1e2}'),
        (CompletionRequest, b'{"prompt": "a", "prompt": "b", "stream": "true", "lora": [{}]}'),
        (CompletionRequest, b'{"prompt": "\\ud83d\\ude00 \\u00e9", "stop": "x", "model": {}}'),
        (CompletionRequest, b'{"prompt": "a", "seed": 18446744073709551615, "top_p": "0.5"}'),
        (OpenAICompletionRequest, b'{"prompt": "a", "suffix": "b", "max_tokens": 3, "n": 2}'),
        (InfillRequest, b'{"input_prefix": [1, "x"], "input_suffix": "", "samplers": "kp"}'),
        (TokenizeRequest, b"{}"),
    ]
    for model, raw in odd:
        _same(model, raw)
    with pytest.raises(InvalidRequest, match="n_predict: Input should be greater"):
        parse_body(CompletionRequest, b'{"prompt": "a", "n_predict": -5}')


def test_the_router_still_answers_everything_else(client: TestClient) -> None:
    missing = client.get("/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    wrong = client.get("/infill")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    assert client.get("/openapi.json").json()["paths"]["/infill"]["post"]
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/tokenize", json={"content": "ab"}).json() == {"tokens": [107, 108]}


def test_an_error_raised_in_a_route_is_a_500_in_llama_server_format(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc = client.app.state.service  # type: ignore[attr-defined]

    def broken(_body: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(svc, "params", broken)
    r = client.post("/infill", content=json.dumps(INFILL))
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"


def test_metrics_and_log_line_are_complete_once_the_answer_is_out(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=logs.REQUESTS)
    assert client.post("/infill", content=json.dumps(INFILL)).status_code == 200
    line = next(r for r in caplog.records if r.name == logs.REQUESTS and "/infill" in r.message)
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["status"] == 200 and fields["n_prompt"] > 0 and fields["predicted"] == 2
    text = client.get("/metrics").text
    assert 'localspec_requests_total{endpoint="infill",outcome="ok"} 1.0' in text
    assert "localspec_server_overhead_seconds_count 1.0" in text
    assert 'localspec_http_requests_total{route="/infill",status="200"} 1.0' in text


def test_lean_routes_refuse_parameters_they_would_not_fill() -> None:
    router = APIRouter(route_class=LeanRoute)

    async def needs_a_query(limit: int) -> Any:
        return None

    with pytest.raises(TypeError, match="limit"):
        router.get("/x")(needs_a_query)


async def _path_of(request: Request) -> str:
    return request.url.path


def _blocking(request: Request) -> str:  # FastAPI would run it in a thread
    return ""


async def _nested(limit: int) -> str:
    return ""


async def _where(at: Annotated[str, Depends(_path_of)]) -> Response:
    return Response(at)


async def _blocked(x: Annotated[str, Depends(_blocking)]) -> Response:
    return Response(x)


async def _queried(x: Annotated[str, Depends(_nested)]) -> Response:
    return Response(x)


def test_lean_routes_solve_their_dependencies_with_the_declared_functions() -> None:
    router = APIRouter(route_class=LeanRoute)
    router.get("/where")(_where)
    app = FastAPI()
    app.include_router(router)
    with TestClient(app) as c:
        assert c.get("/where").text == "/where"
    for endpoint in (_blocked, _queried):  # what this handler would not solve as FastAPI does
        with pytest.raises(TypeError, match="dependency x"):
            router.get("/y")(endpoint)


def test_detokenize_joins_remembered_pieces_like_the_vocabulary() -> None:
    vocab, cache = FakeVocab(), TokenCache()
    head = list(range(20, 20 + 300))
    for tail in ([7, 8, 30], [31, 7, 8, 7], [], [8]):  # é split over two tokens, or half of it
        tokens = [*head, *tail]
        assert cache.detokenize(vocab, tokens) == vocab.detokenize(tokens)
    expected = vocab.detokenize([*head, 999, 7, 8])
    vocab.piece_calls = 0
    assert cache.detokenize(vocab, [*head, 999, 7, 8]) == expected
    assert vocab.piece_calls == 1  # only the token never seen (999) reaches the vocabulary


def test_generation_parameters_are_parsed_once_per_distinct_set(client: TestClient) -> None:
    svc = client.app.state.service  # type: ignore[attr-defined]
    a = InfillRequest.model_validate({**INFILL, "top_k": 5, "stop": ["\n"]})
    b = InfillRequest.model_validate({**INFILL, "input_prefix": "other", "top_k": 5,
                                      "stop": ["\n"]})  # fmt: skip
    c = InfillRequest.model_validate({**INFILL, "top_k": 6, "stop": ["\n"]})
    assert svc.params(a) is svc.params(b)  # only the text differs
    assert svc.params(c) is not svc.params(a)
    assert svc.params(c).request.sampling.top_k == 6 and svc.params(a).request.stop == ("\n",)
    assert svc.params(a).settings_json["speculative.n_max"] is not None  # server defaults in
    odd = InfillRequest.model_validate({**INFILL, "lora": [{"id": 0}], "model": {"x": 1}})
    assert svc.params(odd).request.n_predict == 2  # unhashable ignored fields: still parsed


def test_dumps_writes_what_json_dumps_wrote() -> None:
    from localspec.bench.corpus import stdlib_path
    from localspec.bench.overhead import editor_requests

    body = editor_requests(stdlib_path("argparse.py"), 1, 4)[0]
    text = "".join(c["text"] for c in body["input_extra"]) + body["input_prefix"] + "\x1f\u2028é😀"
    obj = {"content": 'a"b\\', "prompt": text, "tokens": [1, 2], "ok": True, "none": None,
           "timings": {"ms": 1.5, "rate": 1e16, "n": 2**40}, "s": ["NaN", "Infinity"]}  # fmt: skip
    assert dumps(obj) == json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    assert dumps({"x": "a\ud800b"}) == b'{"x":"a?b"}'  # a lone surrogate, replaced as before
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            dumps({"timings": {"ms": bad}})

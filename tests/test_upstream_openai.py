"""The ``openai`` backend kind: localspec lays the FIM prompt out as text and sends it to an
OpenAI-style ``/v1/completions``, then answers in llama-server's shape.

The real path runs against localspec's own ``/v1/completions`` over HTTP (its own process),
which also shows what the upstream evaluated: its request log counts the prompt's tokens. A
scripted server on loopback streams known text, to check the exact prompt, the sampler
mapping and the stop rules applied to the stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localspec.server.prompts import Extra
from localspec.server.upstream.fim_text import infill_text
from tests.upstream_support import (
    QWEN_FIM,
    Daemon,
    Scripted,
    daemon,
    props,
    serve_app,
    sse_objects,
    upstream_config,
    wait_for,
)

EXTRA = [{"text": "import os\n\nROOT = os.getcwd()\n", "filename": "/p/util.py", "time": 1}]
FIM_BODY = {
    "input_prefix": "def add(a, b):\n",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "input_extra": EXTRA,
    "prompt": "    return ",
    "n_predict": 8,
    "top_k": 1,
    "samplers": ["top_k"],
    "cache_prompt": True,
}


@pytest.fixture(scope="module")
def team(qwen_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with daemon(tmp_path_factory.mktemp("team"), model=str(qwen_target), n_ctx=2048) as d:
        yield d


@pytest.fixture(scope="module")
def proxy(team: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with daemon(
        tmp_path_factory.mktemp("proxy"), upstream=upstream_config(team.url, kind="openai")
    ) as d:
        yield d


def test_infill_through_localspecs_own_openai_api(team: Daemon, proxy: Daemon) -> None:
    r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert isinstance(answer["content"], str) and answer["stop"] is True
    assert answer["stop_type"] in ("eos", "limit")
    assert answer["generation_settings"]["n_ctx"] == 2048  # the upstream's, from /v1/models
    assert 1 <= answer["timings"]["predicted_n"] <= 8 == answer["generation_settings"]["n_predict"]
    assert answer["tokens_predicted"] == answer["timings"]["predicted_n"]
    assert answer["timings"]["prompt_ms"] > 0
    # the upstream evaluated exactly local serving's layout, as text: its request log counts
    # the prompt's tokens, and its tokenizer counts those of the layout the same
    text = infill_text(
        QWEN_FIM,
        input_prefix=FIM_BODY["input_prefix"],
        input_suffix=FIM_BODY["input_suffix"],
        input_extra=[Extra(e["text"], e["filename"]) for e in EXTRA],
        prompt=FIM_BODY["prompt"],
        n_ctx=2048,
    )
    assert answer["prompt"] == text
    tokens = httpx.post(
        team.url + "/tokenize", json={"content": text, "parse_special": True}
    ).json()["tokens"]
    assert tokens[0] == 151663 and 151660 in tokens  # <|repo_name|> ... <|fim_middle|>
    line = team.lines("/v1/completions")[-1]
    assert line["n_prompt"] == len(tokens)


def test_stream_several_completions_and_a_warm_up(proxy: Daemon) -> None:
    r = httpx.post(proxy.url + "/infill", json={**FIM_BODY, "stream": True}, timeout=60)
    events = sse_objects(r.text)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[0]["stop"] is False and events[-1]["stop"] is True
    assert events[-1]["content"] == "" and "timings" in events[-1]
    several = httpx.post(proxy.url + "/infill", json={**FIM_BODY, "n_cmpl": 2}, timeout=60)
    answers = several.json()
    assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1]
    warm = {**FIM_BODY, "input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0}
    r = httpx.post(proxy.url + "/infill", json={**warm, "samplers": []}, timeout=60)
    assert r.status_code == 200 and r.json()["content"] == ""
    fields = {**FIM_BODY, "response_fields": ["content", "timings/predicted_n"]}
    assert set(httpx.post(proxy.url + "/infill", json=fields, timeout=60).json()) == {
        "content",
        "timings/predicted_n",
    }


def test_other_routes_through_an_openai_upstream(proxy: Daemon) -> None:
    r = httpx.post(proxy.url + "/completion", json={"prompt": "def f", "n_predict": 4}, timeout=60)
    assert r.status_code == 200 and isinstance(r.json()["content"], str)
    relayed = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert relayed.json()["object"] == "text_completion"
    assert httpx.get(proxy.url + "/v1/models").json()["data"]
    p = props(proxy.url)
    assert p["n_ctx"] == 2048 and p["backend"]["kind"] == "openai"
    assert p["backend"]["fim_model"] == "qwen2.5-coder-1.5b" and "localspec" in p["build_info"]
    tok = httpx.post(proxy.url + "/tokenize", json={"content": "x"})
    assert tok.status_code == 501
    assert "needs the model's tokenizer" in tok.json()["error"]["message"]
    ids = httpx.post(proxy.url + "/completion", json={"prompt": [1, 2, 3]})
    assert ids.status_code == 400 and "send text" in ids.json()["error"]["message"]
    probs = httpx.post(proxy.url + "/infill", json={**FIM_BODY, "n_probs": 2})
    assert probs.status_code == 501 and probs.json()["error"]["type"] == "not_supported_error"


def test_the_prompt_and_samplers_the_upstream_gets(tmp_path: Path) -> None:
    scripted = Scripted(pieces=["x", " = ", "1"])
    with serve_app(scripted.app()) as served:
        config = upstream_config(served.url, kind="openai", model="scripted")
        with daemon(tmp_path, upstream=config) as proxy:
            vscode = {
                **FIM_BODY,
                "n_predict": 128,
                "n_cmpl": 3,
                "top_k": 40,
                "top_p": 0.99,
                "samplers": ["top_k", "top_p", "infill"],
                "t_max_predict_ms": 500,
            }
            r = httpx.post(proxy.url + "/infill", json=vscode, timeout=60)
            assert [a["content"] for a in r.json()] == ["x = 1"] * 3
            sent = scripted.bodies[-1]
            assert sent["prompt"] == r.json()[0]["prompt"]
            assert sent["prompt"].endswith("<|fim_middle|>    return ")  # typed text last
            assert (sent["n"], sent["max_tokens"], sent["model"], sent["stream"]) == (
                3,
                128,
                "scripted",
                True,
            )
            assert (sent["temperature"], sent["top_k"], sent["top_p"], sent["min_p"]) == (
                1.0,
                40,
                0.99,
                0.0,
            )
            assert "<|file_sep|>" in sent["stop"] and sent["skip_special_tokens"] is False
            timings = r.json()[0]["timings"]
            assert (timings["cache_n"], timings["prompt_n"]) == (30, 10)  # from usage
            assert props(proxy.url)["n_ctx"] == 4096  # vLLM's max_model_len


def test_stop_rules_end_the_upstream_stream(tmp_path: Path) -> None:
    lines = ["a = 1\n", "    b = 2\n", "c = 3\n"] + [f"d{i}\n" for i in range(200)]
    scripted = Scripted(pieces=lines, piece_s=0.02)
    with serve_app(scripted.app()) as served:
        config = upstream_config(served.url, kind="openai", model="scripted")
        with daemon(tmp_path, upstream=config) as proxy:
            body = {**FIM_BODY, "n_predict": 500, "n_indent": 4}
            r = httpx.post(proxy.url + "/infill", json=body, timeout=60)
            answer = r.json()
            assert answer["content"] == "a = 1\n    b = 2\n" and answer["stop_type"] == "limit"
            # the upstream's stream was closed there: it never sent its [DONE]
            wait_for(lambda: scripted.closed[-1] is True, 5, "the stream is closed")
            stop = {**FIM_BODY, "n_predict": 500, "stop": ["c ="]}
            answer = httpx.post(proxy.url + "/infill", json=stop, timeout=60).json()
            assert answer["content"] == "a = 1\n    b = 2\n" and answer["stop_type"] == "word"
            assert answer["stopping_word"] == "c ="


def test_upstream_errors_arrive_in_llama_servers_shape(tmp_path: Path) -> None:
    error = {"object": "error", "message": "This model's maximum context length is 4096 tokens",
             "type": "BadRequestError", "code": 400}  # fmt: skip
    scripted = Scripted(status=400, error=error, key="team-key")
    with serve_app(scripted.app()) as served:
        config = upstream_config(served.url, kind="openai", model="scripted", api_key="team-key")
        with daemon(tmp_path, upstream=config) as proxy:
            r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
            assert r.status_code == 400
            assert r.json() == {
                "error": {
                    "code": 400,
                    "message": f"upstream {served.url}: {error['message']}",
                    "type": "invalid_request_error",
                }
            }
        wrong = upstream_config(served.url, kind="openai", model="scripted", api_key="nope")
        with daemon(tmp_path, upstream=wrong) as proxy:
            r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
            assert r.status_code == 401
            assert "refuses localspec's key" in r.json()["error"]["message"]
            assert props(proxy.url)["backend"]["status"] == "refused"


def test_a_prompt_over_the_upstreams_context_is_laid_out_again_shorter(tmp_path: Path) -> None:
    """Code that tokenizes worse than the layout's budget assumes passes the upstream's
    context: vLLM's 400 says by how much, and the /infill goes again, laid out shorter, with
    the typed text still last; a /completion prompt is the editor's own text: the 400."""
    ring = [
        {"text": f"def f{i}(x):\n    return x * {i}\n" * 20, "filename": f"/p/m{i}.py", "time": i}
        for i in range(16)
    ]
    scripted = Scripted(pieces=["x"], max_prompt_chars=6000)
    with serve_app(scripted.app()) as served:
        config = upstream_config(served.url, kind="openai", model="scripted")
        with daemon(tmp_path, upstream=config) as proxy:
            r = httpx.post(
                proxy.url + "/infill", json={**FIM_BODY, "input_extra": ring}, timeout=60
            )
            assert r.status_code == 200, r.text
            assert r.json()["content"] == "x"
            first, second = (b["prompt"] for b in scripted.bodies)
            assert len(first) > 6000 >= len(second)
            assert second.endswith("<|fim_middle|>    return ")
            scripted.bodies.clear()
            long = httpx.post(proxy.url + "/completion", json={"prompt": "a" * 7000}, timeout=60)
            assert long.status_code == 400 and "maximum context length" in long.text
            assert len(scripted.bodies) == 1


def test_a_server_that_does_not_stream_is_understood(tmp_path: Path) -> None:
    scripted = Scripted(pieces=["a = 1\n", "b = 2\n"], whole=True, finish="length")
    with serve_app(scripted.app()) as served:
        config = upstream_config(served.url, kind="openai", model="scripted")
        with daemon(tmp_path, upstream=config) as proxy:
            answer = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60).json()
            assert answer["content"] == "a = 1\nb = 2\n" and answer["stop_type"] == "limit"
            assert answer["timings"]["cache_n"] == 30
            streamed = httpx.post(
                proxy.url + "/infill", json={**FIM_BODY, "stream": True}, timeout=60
            )
            events = sse_objects(streamed.text)
            assert "".join(e.get("content", "") for e in events) == "a = 1\nb = 2\n"
            assert events[-1]["stop"] is True


@pytest.mark.parametrize(
    ("kind", "model", "expected"),
    [
        ("openai", None, "scripted"),  # the model the upstream lists (OpenAI servers need one)
        ("openai", "team-model", "team-model"),
        ("llama-server", None, None),  # dropped: the server answers with its own model
        ("llama-server", "team-model", "team-model"),
    ],
)
def test_the_editors_model_name_never_reaches_the_upstream(
    kind: str, model: str | None, expected: str | None, tmp_path: Path
) -> None:
    """C6: llama-vscode sends its own model names, which the team server may refuse or use to
    pick another model: every generation request gets the profile's ``backend.model``, else
    (openai) the model the upstream lists, else (llama-server) none."""
    scripted = Scripted(pieces=["x"])
    with serve_app(scripted.app()) as served:
        over = {"model": model} if model else {}
        with daemon(tmp_path, upstream=upstream_config(served.url, kind=kind, **over)) as proxy:
            editor = "qwen2.5-coder:1.5b-editors-own"
            chat = {"model": editor, "messages": [{"role": "user", "content": "hi"}]}
            for path, body in (
                ("/infill", {**FIM_BODY, "model": editor}),
                ("/v1/completions", {"model": editor, "prompt": "x", "stream": True}),
                ("/v1/chat/completions", chat),
            ):
                r = httpx.post(proxy.url + path, json=body, timeout=60)
                assert r.status_code == 200, (path, r.text)
                assert r.headers["x-localspec-backend"] == "upstream"
                assert scripted.bodies[-1].get("model") == expected, path

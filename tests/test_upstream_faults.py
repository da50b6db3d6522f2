"""A team server that misbehaves at the byte level, with the local model standing by: what the
editor gets must be an answer (the local model's, when the upstream's had not begun) or an
error in llama-server's shape, and the daemon must stop sending work to an upstream that keeps
failing or asks for a pause.

The upstream is :class:`RawUpstream` (asyncio streams on loopback), the daemon under test a
real process in front of it, as ``localspec up`` runs it.
"""

from __future__ import annotations

import contextlib
import gzip
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.upstream_support import (
    Daemon,
    RawUpstream,
    Script,
    daemon,
    event_stream,
    http_answer,
    launch,
    props,
    sse_objects,
    upstream_config,
    wait_for,
    wait_local,
)

INFILL = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    return ",
          "n_predict": 4, "top_k": 1, "samplers": ["top_k"]}  # fmt: skip


@contextlib.contextmanager
def proxied(
    script: Script, qwen_target: Path, tmp: Path, kind: str = "llama-server", **over: Any
) -> Iterator[tuple[RawUpstream, Daemon]]:
    raw = RawUpstream(script)
    try:
        config = upstream_config(raw.url, kind, **over)
        with daemon(tmp, model=str(qwen_target), upstream=config, alias="local") as proxy:
            wait_local(proxy)
            yield raw, proxy
    finally:
        raw.close()


def _errors(proxy: Daemon) -> list[str]:
    """The log's ERROR records (an upstream's fault is a warning, never a traceback)."""
    return [e.get("message", "") for e in proxy.records() if e.get("level") == "error"]


def test_a_stream_a_proxy_compressed_reaches_the_editor_as_events(
    qwen_target: Path, tmp_path: Path
) -> None:
    events = [{"content": "a", "stop": False}, {"content": "b", "stop": True}]
    gzipped = event_stream(*events, headers="Content-Encoding: gzip\r\n", encode=gzip.compress)
    with proxied(lambda _path, _body: gzipped, qwen_target, tmp_path) as (raw, proxy):
        r = httpx.post(proxy.url + "/completion", json={"prompt": "x", "stream": True}, timeout=60)
        assert r.headers["x-localspec-backend"] == "upstream"
        assert sse_objects(r.text) == events
        assert raw.posts[0][1]["accept-encoding"] == "identity"  # and asks for none


@pytest.mark.parametrize(
    ("stream", "script", "reason"),
    [
        (True, event_stream(), "closed"),  # the stream ends before its first event
        (False, http_answer(200, b"<html>Sign in</html>", content_type="text/html"), "error"),
        (False, http_answer(200, b"Please sign in"), "error"),  # says JSON, is not
    ],
    ids=["empty-stream", "login-page", "not-json"],
)
def test_an_answer_that_is_none_is_the_local_models_to_give(
    stream: bool, script: bytes, reason: str, qwen_target: Path, tmp_path: Path
) -> None:
    with proxied(lambda _path, _body: script, qwen_target, tmp_path) as (raw, proxy):
        r = httpx.post(proxy.url + "/infill", json={**INFILL, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-localspec-backend"] == "local"
        answers = sse_objects(r.text) if stream else [r.json()]
        assert answers[-1]["stop"] is True and answers[-1]["model"] == "local"
        assert len(raw.posts) == 1
        assert proxy.lines("/infill")[0]["fallback"] == reason


def test_a_pause_the_upstream_asks_for_is_kept(qwen_target: Path, tmp_path: Path) -> None:
    busy = http_answer(429, {"error": "rate limited"}, headers="Retry-After: 60\r\n")
    with proxied(lambda _path, _body: busy, qwen_target, tmp_path) as (raw, proxy):
        for _ in range(3):
            r = httpx.post(proxy.url + "/infill", json=INFILL, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == "local", r.text
        assert len(raw.posts) == 1  # asked once; the pause holds although its checks pass
        assert [e["fallback"] for e in proxy.lines("/infill", 3)] == [
            "unavailable",
            "busy",
            "busy",
        ]
        assert props(proxy.url)["backend"]["status"] == "busy"


def test_an_upstream_status_reaches_the_editor_as_its_own_code(
    qwen_target: Path, tmp_path: Path
) -> None:
    teapot = http_answer(418, {"detail": "I'm a teapot"})
    with proxied(lambda _path, _body: teapot, qwen_target, tmp_path) as (_raw, proxy):
        r = httpx.post(proxy.url + "/infill", json=INFILL, timeout=60)
        assert r.status_code == 418
        assert r.json()["error"]["code"] == 418
        assert "I'm a teapot" in r.json()["error"]["message"]


def _cut_after_one_event(_path: str, _body: dict[str, Any]) -> bytes:
    """A chunked stream cut after its first event (a proxy's timeout, while the server's
    checks pass)."""
    event = b'data: {"content": "a", "stop": false}\n\n'
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    return head + b"%x\r\n%s\r\n" % (len(event), event)


def test_streams_that_keep_breaking_send_the_editor_to_the_local_model(
    qwen_target: Path, tmp_path: Path
) -> None:
    with proxied(_cut_after_one_event, qwen_target, tmp_path, health_interval_s=60.0) as (
        raw,
        proxy,
    ):
        body = {"prompt": "x", "stream": True, "n_predict": 4}
        for n in range(1, 4):
            # the checker finds it up again after each failure (it is: its checks pass)
            wait_for(lambda: props(proxy.url)["backend"]["status"] == "up", 10, "up again")
            r = httpx.post(proxy.url + "/completion", json=body, timeout=60)
            assert sse_objects(r.text)[-1]["error"]["code"] == 503
            assert len(raw.posts) == n
        r = httpx.post(proxy.url + "/completion", json=body, timeout=60)
        assert r.headers["x-localspec-backend"] == "local"
        assert sse_objects(r.text)[-1]["stop"] is True
        assert len(raw.posts) == 3
        assert proxy.lines("/completion", 4)[-1]["fallback"] == "failing"
        assert props(proxy.url)["backend"]["status"] == "failing"
        metrics = httpx.get(proxy.url + "/metrics").text
        assert 'localspec_upstream_failures_total{phase="stream",reason="closed"} 3.0' in metrics


def test_a_stream_closed_before_its_last_event_is_an_error_not_a_short_answer(
    qwen_target: Path, tmp_path: Path
) -> None:
    """HTTP/1.0-style: the answer ends where the connection does, so a cut there is no
    protocol error; only the missing last event (``stop: true``, ``[DONE]``) tells."""

    def cut(path: str, _body: dict[str, Any]) -> bytes:
        if path == "/v1/completions":
            return event_stream({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
        return event_stream({"content": "a", "stop": False})

    def whole(path: str, _body: dict[str, Any]) -> bytes:
        if path == "/v1/completions":
            return event_stream({"choices": [{"index": 0, "text": "a"}]}, "[DONE]")
        return event_stream({"content": "a", "stop": False}, {"content": "", "stop": True})

    script: list[Script] = [cut]
    with proxied(lambda p, b: script[0](p, b), qwen_target, tmp_path) as (_raw, proxy):
        body = {"prompt": "x", "stream": True, "n_predict": 4}
        for path in ("/completion", "/v1/completions"):
            wait_for(lambda: props(proxy.url)["backend"]["status"] == "up", 10, "up")
            r = httpx.post(proxy.url + path, json=body, timeout=60)
            assert r.headers["x-localspec-backend"] == "upstream"
            events = sse_objects(r.text)
            assert events[-1]["error"]["code"] == 503, events
            assert "closed its stream before the last event" in events[-1]["error"]["message"]
        metrics = httpx.get(proxy.url + "/metrics").text
        assert 'localspec_upstream_failures_total{phase="stream",reason="closed"} 2.0' in metrics
        script[0] = whole  # a whole stream passes as it came
        wait_for(lambda: props(proxy.url)["backend"]["status"] == "up", 10, "up again")
        r = httpx.post(proxy.url + "/completion", json=body | {"prompt": "y"}, timeout=60)
        assert sse_objects(r.text)[-1] == {"content": "", "stop": True}
        assert not _errors(proxy)


def _piece(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"choices": 5}, "not a completion chunk"),
        ({"choices": [{"index": "zero", "text": "b"}]}, "not a completion chunk"),
        ('{"choices": [{"index": 0, "text": "b", "finish', "not JSON"),
    ],
    ids=["choices-int", "index-str", "cut-json"],
)
def test_an_openai_event_that_is_not_a_chunk_ends_the_stream_with_an_error(
    bad: Any, says: str, qwen_target: Path, tmp_path: Path
) -> None:
    stream = event_stream(_piece("a"), bad, _piece("c"), "[DONE]")
    with proxied(lambda _p, _b: stream, qwen_target, tmp_path, kind="openai") as (_raw, proxy):
        r = httpx.post(proxy.url + "/infill", json={**INFILL, "stream": True}, timeout=60)
        events = sse_objects(r.text)
        assert [e.get("content") for e in events[:-1]] == ["a"]  # never "c" as if "b" were not
        assert events[-1]["error"]["code"] == 503 and says in events[-1]["error"]["message"]
        assert _errors(proxy) == []


def test_an_openai_answer_without_choices_is_the_local_models_to_give(
    qwen_target: Path, tmp_path: Path
) -> None:
    whole = http_answer(200, {"choices": 5})
    with proxied(lambda _p, _b: whole, qwen_target, tmp_path, kind="openai") as (_raw, proxy):
        r = httpx.post(proxy.url + "/infill", json=INFILL, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "local", r.text
        assert proxy.lines("/infill")[0]["fallback"] == "error"
        assert _errors(proxy) == []


def test_a_team_server_that_never_answers_its_checks_does_not_hold_the_daemon(
    qwen_target: Path, tmp_path: Path
) -> None:
    raw = RawUpstream(lambda _p, _b: b"", checks_hang=True)
    config = upstream_config(raw.url, read_timeout_s=300.0)  # a generation may take that long
    try:
        proxy = launch(
            tmp_path, model=str(qwen_target), upstream=config, alias="local", ready=False
        )
        try:
            t0 = time.monotonic()

            def answered() -> bool:
                with contextlib.suppress(httpx.TransportError):
                    r = httpx.post(proxy.url + "/infill", json=INFILL, timeout=5)
                    return r.status_code == 200 and r.json()["model"] == "local"
                return False

            wait_for(answered, 60, "the local model answers")
            assert time.monotonic() - t0 < 60
            assert "health check got no answer" in props(proxy.url)["backend"]["error"]
        finally:
            proxy.kill()
    finally:
        raw.close()


@pytest.mark.parametrize("kind", ["llama-server", "openai"])
def test_a_kept_alive_connection_the_upstream_closed_is_no_failure(
    kind: str, tmp_path: Path
) -> None:
    """D2: the upstream closes a pooled connection just as a check or a request is sent on it
    (its idle timeout crossing the request): that is sent again on a new connection, not
    counted a failure that marks the upstream down. No local model: a spurious failure would
    be a 503 here."""
    done = {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}
    answers = {
        "/completion": http_answer(200, {"content": "a", "stop": True}),
        "/v1/completions": http_answer(200, done),
    }
    raw = RawUpstream(lambda path, _b: answers[path], keep_alive=True, answers_per_connection=1)
    try:
        proxy = launch(tmp_path, upstream=upstream_config(raw.url, kind), ready=False)
        try:

            def status() -> str:
                r = httpx.get(proxy.url + "/props", timeout=10)
                return r.json()["backend"]["status"] if r.status_code == 200 else r.text

            wait_for(lambda: status() == "up", 20, f"the upstream is up ({status()})")
            for _ in range(4):  # each after the checks (every 0.5 s) used the pooled connection
                time.sleep(0.6)
                r = httpx.post(proxy.url + "/completion", json={"prompt": "x"}, timeout=30)
                assert r.status_code == 200, r.text
                assert r.headers["x-localspec-backend"] == "upstream"
            backend = props(proxy.url)["backend"]
            assert backend["status"] == "up" and backend["error"] == ""
            assert raw.dropped >= 4  # the race did happen, to checks and requests
            assert (
                "localspec_upstream_failures_total{" not in httpx.get(proxy.url + "/metrics").text
            )
            assert [e.get("fallback") for e in proxy.lines("/completion", 4)] == [None] * 4
        finally:
            proxy.kill()
    finally:
        raw.close()


def test_a_multi_choice_stream_cut_before_every_choice_ended_is_an_error(
    qwen_target: Path, tmp_path: Path
) -> None:
    """D4: with ``n_cmpl`` 2 a llama-server stream holds a final event (``stop: true``) per
    choice; one cut after the first choice's final is short by a whole choice, an error
    event, not an answer."""

    def events(*finals: int) -> list[dict[str, Any]]:
        pieces = [{"index": i, "content": "a", "stop": False} for i in (0, 1)]
        return [*pieces, *({"index": i, "content": "", "stop": True} for i in finals)]

    script = [event_stream(*events(0))]
    with proxied(lambda _p, _b: script[0], qwen_target, tmp_path) as (_raw, proxy):
        body = {**INFILL, "n_cmpl": 2, "stream": True}
        r = httpx.post(proxy.url + "/infill", json=body, timeout=60)
        assert r.headers["x-localspec-backend"] == "upstream"
        got = sse_objects(r.text)
        assert got[:-1] == events(0)
        assert "closed its stream before the last event" in got[-1]["error"]["message"], got
        script[0] = event_stream(*events(1, 0))  # every choice ended (in any order): whole
        wait_for(lambda: props(proxy.url)["backend"]["status"] == "up", 10, "up again")
        r = httpx.post(proxy.url + "/infill", json=body | {"prompt": "y"}, timeout=60)
        assert sse_objects(r.text) == events(1, 0)
        assert not _errors(proxy)

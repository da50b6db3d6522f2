"""Bad input, limits, truncation, metrics, request logs and security, over real HTTP on loopback
with the real engine on the tiny Qwen-vocabulary fixture (one daemon for the module)."""

from __future__ import annotations

import http.client
import io
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from localspec.server import ServerSettings, create_app, logs
from localspec.server.prompts import truncate
from localspec.server.requests import MAX_EXTRA_CHUNKS
from tests.fake_engine import StepEngine
from tests.ops_support import (
    AUTH,
    KEY,
    Live,
    engine_settings,
    infill_body,
    start,
    stop,
    wait_until,
)

N_CTX = 512
MAX_BODY = 256 * 1024
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def live(qwen_target: Path) -> Iterator[Live]:
    # a 512-token context: the /infill window its 256-token batch gave it before the window
    # was a setting, so the layouts (and the slots they land on) are the ones these tests chose
    settings = ServerSettings(
        port=0, api_key=KEY, max_body_bytes=MAX_BODY, body_timeout_s=BODY_TIMEOUT,
        infill_window=256,
    )  # fmt: skip
    server = start(settings, engine_settings(qwen_target, n_ctx=N_CTX, n_batch=256))
    yield server
    stop(server)


@pytest.fixture
def c(live: Live) -> Iterator[httpx.Client]:
    with live.client(headers=AUTH) as client:
        yield client


def ok_infill(c: httpx.Client) -> None:
    r = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 2})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- bad input

BIG = 10**20
BAD: list[tuple[str, str, bytes | dict[str, Any] | list[Any], int, str]] = [
    # (name, route, body, status, a word the message must contain)
    ("malformed JSON", "/infill", b'{"input_prefix": "a", ', 400, "JSON"),
    ("not an object", "/completion", b"[1, 2, 3]", 400, "Invalid"),
    ("empty body", "/completion", b"", 400, "Invalid"),
    ("invalid UTF-8", "/completion", b'{"prompt": "\xff\xfe\xfd"}', 400, ""),
    ("lone surrogate", "/completion", b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("NaN", "/completion", b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("wrong type: prefix", "/infill", {"input_prefix": 5, "input_suffix": ""}, 400, "prefix"),
    ("wrong type: n_predict", "/completion", {"prompt": "a", "n_predict": "ten"}, 400, "n_predict"),
    ("wrong type: extra", "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": "x"},
     400, "input_extra"),
    ("wrong type: stream", "/completion", {"prompt": "a", "stream": "maybe"}, 400, "stream"),
    ("negative n_predict", "/completion", {"prompt": "a", "n_predict": -5}, 400, "n_predict"),
    ("negative id_slot", "/completion", {"prompt": "a", "id_slot": -2}, 400, "id_slot"),
    ("zero n_cmpl", "/completion", {"prompt": "a", "n_cmpl": 0}, 400, "n_cmpl"),
    ("negative n_indent", "/infill", {"input_prefix": "", "input_suffix": "", "n_indent": -1},
     400, "n_indent"),
    ("huge n_predict", "/completion", {"prompt": "a", "n_predict": BIG}, 400, "n_predict"),
    ("huge seed", "/completion", {"prompt": "a", "seed": BIG * BIG}, 400, "seed"),
    ("huge top_k", "/completion", {"prompt": "a", "top_k": 2**40}, 400, "top_k"),
    ("huge n_cmpl", "/completion", {"prompt": "a", "n_cmpl": 10**6}, 400, "n_cmpl"),
    ("huge draft", "/completion", {"prompt": "a", "speculative.n_max": 10**6}, 400, "n_max"),
    ("huge token id", "/completion", {"prompt": [1, 10**12]}, 400, "token id"),
    ("5000-digit number", "/completion", b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", 400,
     ""),
    ("unknown sampler", "/completion", {"prompt": "a", "samplers": ["top_k", "bogus"]}, 400,
     "bogus"),
    ("unknown sampler code", "/infill", {"input_prefix": "", "input_suffix": "", "samplers": "kz"},
     400, "'z'"),
    ("empty extra item", "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{}]},
     400, "text"),
    ("extra item without text", "/infill",
     {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a.py"}]}, 400, "text"),
    ("extra text not a string", "/infill",
     {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": 5}]}, 400, "text"),
    ("10k ring chunks", "/infill",
     {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x"}] * 10_000}, 400,
     "input_extra"),
    ("bad detokenize id", "/detokenize", {"tokens": [-1]}, 400, "token id"),
    # llama.cpp aborts the process on such an id (found by the fuzzer): checked before
    ("bad tokenize id", "/tokenize", {"content": [5, 10**6], "with_pieces": True}, 400,
     "token id"),
    ("wrong tokenize type", "/tokenize", {"content": 5}, 400, "content"),
]  # fmt: skip


@pytest.mark.parametrize("name,route,body,status,word", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx_and_the_daemon_is_unaffected(
    c: httpx.Client,
    caplog: pytest.LogCaptureFixture,
    name: str,
    route: str,
    body: Any,
    status: int,
    word: str,
) -> None:
    caplog.set_level(logging.WARNING)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = c.post(route, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, (name, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error"
    assert err["message"] and word in err["message"], err["message"]
    ok_infill(c)  # the daemon is unaffected
    # a client's mistake is on its request line, not an error with a traceback in the log
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], name


def test_10k_ring_chunks_limit_is_exactly_the_documented_one(c: httpx.Client) -> None:
    body = infill_body(0, n_predict=1, input_extra=[{"text": "x = 1\n"}] * MAX_EXTRA_CHUNKS)
    assert c.post("/infill", json=body).status_code == 200
    body["input_extra"].append({"text": "y = 2\n"})
    assert c.post("/infill", json=body).status_code == 400


def test_oversize_bodies_answer_413_declared_or_chunked(c: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    r = c.post("/completion", content=big)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == 413 and "too large" in err["message"] and err["type"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the gate counts as it reads
        for i in range(0, len(big), 16384):
            yield big[i : i + 16384]

    r = c.post("/completion", content=chunks())
    assert r.status_code == 413
    # far past the limit and the socket buffers, from a client that sends its whole body
    # before it reads (Python's http.client, so urllib and requests): it reads the 413, not a
    # broken pipe (llama-server reads such bodies whole)
    host, port = str(c.base_url).removeprefix("http://").rstrip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/completion", body=b"{" + b" " * (40 * MAX_BODY) + b"}", headers=AUTH)
    answer = conn.getresponse()
    assert answer.status == 413 and b"too large" in answer.read()
    conn.close()
    ok_infill(c)


def raw_request(url: str, head: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head)
    return sock


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_stalled_body_answers_408_and_the_daemon_serves_on(c: httpx.Client, live: Live) -> None:
    """A client that sends half its body and stops: the gate gives up after body_timeout_s."""
    head = (
        f"POST /completion HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    t0 = time.monotonic()
    with raw_request(live.url, head + b'{"prompt": "x') as sock:
        answer = read_response(sock)  # the server closes the connection after the 408
    waited = time.monotonic() - t0
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408"), answer[:200]
    err = json.loads(body)["error"]
    assert err["code"] == 408 and "not received within 2 s" in err["message"]
    assert BODY_TIMEOUT <= waited < BODY_TIMEOUT + 10
    ok_infill(c)


def test_connections_past_the_cap_answer_503(qwen_target: Path) -> None:
    live = start(
        ServerSettings(port=0, max_connections=2), engine_settings(qwen_target, n_ctx=N_CTX)
    )
    try:
        idle = [raw_request(live.url, b"") for _ in range(2)]
        with httpx.Client(timeout=30) as c:
            # the server counts a connection once it has accepted it, and frees it once it has
            # seen it close: ask until it has (a loaded machine takes longer than a fixed sleep)
            assert _health_becomes(c, live.url, 503)
            for sock in idle:
                sock.close()
            assert _health_becomes(c, live.url, 200)
    finally:
        stop(live)


def _health_becomes(c: httpx.Client, url: str, status: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while c.get(url + "/health").status_code != status:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_empty_extra_text_is_fine_like_llama_server(c: httpx.Client) -> None:
    body = infill_body(1, n_predict=1, input_extra=[{"text": ""}, {"text": "", "filename": ""}])
    assert c.post("/infill", json=body).status_code == 200


# ---------------------------------------------------------------------- context limits


def test_truncation_rule_matches_llama_server() -> None:
    tokens = list(range(1000))
    # n_keep 0: drop whole blocks of n_ctx/2 from the start; the newest tokens stay
    assert truncate(tokens, 512, 0) == tokens[512:]
    assert truncate(tokens[:700], 512, 0) == tokens[256:700]
    kept = truncate(tokens, 512, 10)  # n_keep 10: block (512-10)//2 = 251, (1000-10-251)//251 = 2
    assert kept == tokens[:10] + tokens[10 + 2 * 251 :]
    assert len(truncate(tokens, 512, -1)) < 512  # -1: keep all it can (n_ctx - 4)
    assert truncate(tokens[:100], 512, 0) == tokens[:100]
    for n in range(512, 3000, 37):
        for keep in (-1, 0, 1, 100, 508, 600):
            assert len(truncate(list(range(n)), 512, keep)) < 512


def test_prompt_longer_than_context_is_truncated_not_refused(c: httpx.Client) -> None:
    text = "def handler(event, context):\n    return event\n" * 120  # ~1.5k tokens
    tokenized = c.post("/tokenize", json={"content": text, "add_special": True})
    n_prompt = len(tokenized.json()["tokens"])
    assert n_prompt > N_CTX
    r = c.post("/completion", json={"prompt": text, "n_predict": 4, "top_k": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["truncated"] is True
    expected = len(truncate(list(range(n_prompt)), N_CTX, 0))
    assert body["tokens_evaluated"] == expected < N_CTX
    r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "top_k": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] < N_CTX


def test_n_predict_beyond_the_context_is_clamped(c: httpx.Client) -> None:
    r = c.post("/completion", json={"prompt": "x = [", "n_predict": 100_000, "top_k": 1,
                                     "samplers": ["top_k"], "id_slot": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens_evaluated"] + body["tokens_predicted"] <= N_CTX
    assert body["tokens_predicted"] >= N_CTX - body["tokens_evaluated"] - 2
    assert body["stop_type"] == "limit" and body["truncated"] is True


# ---------------------------------------------------------------------- metrics and logs


def test_metrics_cover_requests_latency_tokens_drafts_queue_slots_memory(
    c: httpx.Client, live: Live
) -> None:
    for doc in range(3):  # ngram drafting on repeated code: drafted tokens appear
        assert c.post("/infill", json=infill_body(doc, n_predict=16)).status_code == 200
    assert c.post("/completion", json={"prompt": "a", "n_predict": -5}).status_code == 400
    assert httpx.get(live.url + "/metrics").status_code == 401  # key-protected
    text = c.get("/metrics").text
    wanted = [
        'localspec_http_requests_total{route="/infill",status="200"}',
        'localspec_http_requests_total{route="/completion",status="400"}',
        'localspec_http_requests_total{route="/metrics",status="401"}',
        'localspec_requests_total{endpoint="infill",outcome="ok"}',
        'localspec_request_seconds_bucket{endpoint="infill"',
        'localspec_queue_seconds_bucket{endpoint="infill"',
        'localspec_prompt_seconds_bucket{endpoint="infill"',
        'localspec_generation_seconds_bucket{endpoint="infill"',
        'localspec_http_request_seconds_count{route="/infill"}',
        "localspec_prompt_tokens_evaluated_total",
        "localspec_prompt_tokens_cached_total",
        "localspec_tokens_predicted_total",
        "localspec_answers_on_shifted_kv_total 0.0",  # repeated documents: prefix reuse only
        'localspec_draft_tokens_total{source="ngram"}',
        'localspec_draft_tokens_accepted_total{source="ngram"}',
        'localspec_draft_acceptance_ratio{source="ngram"}',
        'localspec_generation_tokens_per_second_bucket{endpoint="infill"',
        "localspec_queue_depth 0.0",
        'localspec_slots{state="idle"} 2.0',
        'localspec_slots{state="processing"} 0.0',
        'localspec_slot_cached_tokens{slot="0"}',
        'localspec_model_bytes{model="target"}',
        "localspec_requests_cancelled_total",
        "localspec_engine_threads",
        "localspec_cpu_other_busy_cores",
        "process_resident_memory_bytes",
    ]
    missing = [w for w in wanted if w not in text]
    assert not missing, missing
    size = re.search(r'localspec_model_bytes\{model="target"\} (\S+)', text)
    assert size and float(size.group(1)) == os.path.getsize(live.service.engine.model_path)
    ratio = re.search(r'localspec_draft_acceptance_ratio\{source="ngram"\} (\S+)', text)
    assert ratio and 0.0 <= float(ratio.group(1)) <= 1.0


def test_metrics_can_be_switched_off() -> None:
    app = create_app(
        ServerSettings(metrics=False), engine_settings(Path("m.gguf")), load=StepEngine
    )
    with TestClient(app) as client:
        for _ in range(100):
            if client.get("/health").status_code == 200:
                break
        r = client.get("/metrics")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_one_log_line_per_request_with_cache_draft_and_timings(
    c: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=logs.REQUESTS)
    body = infill_body(5, n_predict=8, id_slot=0)
    assert c.post("/infill", json=body).status_code == 200
    assert c.post("/infill", json=body).status_code == 200  # the same again: served from cache
    assert c.post("/completion", json={"prompt": "a", "samplers": ["nope"]}).status_code == 400
    assert c.get("/slots", headers={"Authorization": "Bearer wrong"}).status_code == 401

    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == logs.REQUESTS]

    # a request's line is written once its answer is out: the client can be first
    wait_until(lambda: len(logged()) >= 4)
    records = logged()
    assert len(records) == 4
    first, again, bad, denied = (r.fields for r in records)  # type: ignore[attr-defined]
    for key in ("route", "slot", "evaluated", "reused", "approx", "predicted", "drafted",
                "accepted", "queue_ms", "prompt_ms", "gen_ms", "total_ms", "outcome"):  # fmt: skip
        assert key in again, key
    assert again["route"] == "/infill" and again["status"] == 200 and again["outcome"] == "ok"
    assert again["slot"] == 0 and again["reused"] > 0 and again["evaluated"] < first["n_prompt"]
    assert again["approx"] == 0  # plain prefix reuse: the KV is a cold evaluation's
    assert bad["status"] == 400 and bad["outcome"] == "rejected" and "nope" in bad["error"]
    assert denied["status"] == 401 and denied["route"] == "/slots"
    line = records[1].getMessage()
    assert line.startswith("POST /infill 200 ok ") and "reused=" in line and "drafted=" in line
    assert body["input_prefix"][:20] not in line  # no prompt text at INFO
    as_json = json.loads(logs.JsonFormatter().format(records[1]))
    assert as_json["reused"] == again["reused"] and as_json["logger"] == logs.REQUESTS


def test_configure_json_format_requests_switch_and_debug_bodies() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    levels = {n: logging.getLogger(n).level for n in (logs.REQUESTS, logs.BODIES)}
    try:
        out = io.StringIO()
        logs.configure("info", "json", requests=False, stream=out)
        logs.log_request(logs.RequestLog("POST", "/infill", status=200))
        assert out.getvalue() == ""  # request lines are opt-in
        logs.configure("info", "json", requests=True, stream=out)
        logs.log_request(logs.RequestLog("POST", "/infill", route="/infill", status=200, slot=1))
        entry = json.loads(out.getvalue().splitlines()[-1])
        assert entry["route"] == "/infill" and entry["slot"] == 1 and entry["level"] == "info"
        logs.log_body("POST", "/infill", b'{"input_prefix": "secret code"}')
        assert "secret code" not in out.getvalue()  # bodies only at debug
        out = io.StringIO()
        logs.configure("debug", "text", requests=False, stream=out)
        assert "request bodies" in out.getvalue()  # the warning comes first
        logs.log_body("POST", "/infill", b'{"input_prefix": "secret code"}')
        assert "secret code" in out.getvalue()
        with pytest.raises(ValueError, match="log format"):
            logs.configure("info", "xml")  # type: ignore[arg-type]
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        for name, lvl in levels.items():
            logging.getLogger(name).setLevel(lvl)


# ---------------------------------------------------------------------- security


def served_routes(routes: Any) -> list[tuple[str, str]]:
    """(method, path) of every route, included routers walked into."""
    out: list[tuple[str, str]] = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            out += served_routes(inner.routes)
        else:
            out += [(m, route.path) for m in sorted(route.methods or {"GET"}) if m != "HEAD"]
    return out


def test_every_route_but_health_and_the_chat_page_refuses_a_missing_or_bad_key(live: Live) -> None:
    routes = served_routes(live.server.config.app.routes)  # type: ignore[attr-defined]
    assert {p for _, p in routes} >= {"/infill", "/completion", "/v1/completions", "/metrics",
                                      "/slots", "/props", "/tokenize", "/openapi.json"}  # fmt: skip
    with httpx.Client(base_url=live.url, timeout=30) as anon:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "nope"}):
                r = anon.request(method, path, headers=headers, json={})
                if path in ("/health", "/v1/health", "/", "/index.html", "/stats"):  # static pages
                    assert r.status_code == 200
                else:
                    assert r.status_code == 401, (method, path, r.status_code)
                    assert r.json()["error"]["type"] == "authentication_error"


def test_cors_is_off_by_default(c: httpx.Client) -> None:
    origin = {"Origin": "https://evil.example"}
    pre = c.options("/completion", headers={**origin, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    r = c.get("/props", headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_no_field_or_path_reads_or_writes_files(
    c: httpx.Client, live: Live, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    paths = [p for _, p in served_routes(live.server.config.app.routes)]  # type: ignore[attr-defined]
    # one path parameter: the slot actions' id (server/slot_actions.py), refused here
    assert [p for p in paths if "{" in p] == ["/slots/{id_slot}"], paths
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    before = c.get("/props").json()
    hostile = {
        "prompt": "a",
        "n_predict": 1,
        "model": str(secret),
        "lora": [{"path": str(secret), "scale": 1.0}],
        "filename": "../../evil.bin",
        "slot_save_path": str(tmp_path),
        "grammar_file": str(secret),
        "mmproj": str(secret),
    }
    r = c.post("/completion", json=hostile)
    assert r.status_code == 200 and "TOP SECRET" not in r.text
    for action in ("save", "restore", "erase"):
        r = c.post(f"/slots/0?action={action}", json={"filename": "../evil.bin"})
        assert r.status_code == 400  # no server.slot_save_path: refused, nothing written
    after = c.get("/props").json()
    assert after["model_path"] == before["model_path"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]
    assert not (tmp_path.parent / "evil.bin").exists()

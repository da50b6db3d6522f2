"""The ``llama-server`` backend kind against real upstreams on loopback: a second localspec
daemon as the team server (its own process, so it can be killed), and the daemon under test
in front of it, as ``localspec up`` runs it.

Failures are real too: the upstream killed mid-stream and mid-answer, restarted on its port,
a key it refuses, a server that answers late, an HTTPS server whose certificate nobody
signed. The editor always gets an answer or an error in llama-server's shape.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localspec.server.upstream.identity import stable_slot, workstation
from tests.upstream_support import (
    Daemon,
    Scripted,
    daemon,
    free_port,
    launch,
    props,
    self_signed,
    serve_app,
    sse_objects,
    upstream_config,
    wait_for,
    wait_local,
)

FIM_BODY = {
    "input_prefix": "def add(a, b):\n",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "input_extra": [{"text": "import os\n", "filename": "/p/util.py", "time": 1}],
    "prompt": "    return ",
    "n_predict": 8,
    "top_k": 1,
    "samplers": ["top_k"],
    "cache_prompt": True,
    "id_slot": 0,  # what llama-vscode sends; the team server gets the stable slot instead
}
LONG = {"prompt": "def f():\n", "n_predict": 100000, "top_k": 1, "samplers": ["top_k"]}


@pytest.fixture(scope="module")
def team(qwen_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The shared server: localspec with 4 slots."""
    with daemon(
        tmp_path_factory.mktemp("team"), model=str(qwen_target), n_slots=4, n_ctx=8192
    ) as d:
        yield d


def _predicted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("localspec_tokens_predicted_total "):
            return float(line.split()[1])
    return 0.0


def _working(url: str) -> bool:
    return any(s["is_processing"] for s in httpx.get(url + "/slots", timeout=10).json())


def _quiet(url: str, seconds: float = 0.6) -> bool:
    """The server generates nothing for ``seconds``."""
    before = _predicted(url)
    time.sleep(seconds)
    return _predicted(url) == before


def test_relays_every_route_streams_and_pins_the_stable_slot(team: Daemon, tmp_path: Path) -> None:
    with daemon(tmp_path, upstream=upstream_config(team.url)) as proxy:
        slot = stable_slot(4, workstation())
        r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["id_slot"] == slot and isinstance(answer["content"], str)
        assert answer["generation_settings"]["n_ctx"] == 8192  # the team server's
        assert r.headers["server"].startswith("localspec/")
        assert "upstream;dur=" in r.headers["server-timing"]

        # streamed: passed on as the upstream writes it, several network reads
        reads: list[float] = []
        data = b""
        with httpx.stream(
            "POST", proxy.url + "/completion", json={**LONG, "n_predict": 64, "stream": True},
            timeout=60,
        ) as s:  # fmt: skip
            for chunk in s.iter_raw():
                reads.append(time.monotonic())
                data += chunk
        events = sse_objects(data.decode())
        assert len(events) == 65 and events[-1]["stop"] is True and events[0]["stop"] is False
        assert len(reads) > 2  # not gathered into one answer

        # the other routes the editors use
        p = props(proxy.url)
        assert p["total_slots"] == 4 and p["n_ctx"] == 8192
        queried = httpx.get(proxy.url + "/props", params={"model": "x", "autoload": "false"})
        assert queried.status_code == 200 and queried.json()["backend"]["kind"] == "llama-server"
        assert p["backend"]["answering"] == "upstream" and p["backend"]["id_slot"] == slot
        assert p["backend"]["status"] == "up" and p["backend"]["fallback"] == "none"
        tok = {"content": "def f(): pass", "add_special": False, "parse_special": True}
        direct = httpx.post(team.url + "/tokenize", json=tok).json()
        assert httpx.post(proxy.url + "/tokenize", json=tok).json() == direct
        text = httpx.post(proxy.url + "/detokenize", json={"tokens": direct["tokens"]}).json()
        assert text == {"content": "def f(): pass"}
        assert httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"]
        assert len(httpx.get(proxy.url + "/slots").json()) == 4
        chat = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["object"] == "text_completion"

        line = proxy.lines("/infill")[0]
        assert line["backend"] == "upstream" and "upstream_ms" in line
        assert '"logger": "httpx"' not in (proxy.log_file or Path()).read_text()  # one line each
        metrics = httpx.get(proxy.url + "/metrics").text
        assert 'localspec_backend_answers_total{backend="upstream",route="/infill"} 1.0' in metrics
        assert "localspec_upstream_up 1.0" in metrics


BAD_BODIES = [
    ("/infill", b'{"input_prefix": "a", '),  # not JSON: llama-server answers a 500
    ("/infill", b'{"prompt": "x"}'),  # no input_prefix/input_suffix: llama-server 500 too
    ("/completion", b"[1, 2]"),
    ("/v1/chat/completions", b'"hello"'),
]


def test_multi_choice_streams_arrive_whole_with_their_indexes(team: Daemon, tmp_path: Path) -> None:
    """D4: every choice's events and its final one (with ``index``) arrive through the relay
    as the team server sent them: /infill and /completion with ``n_cmpl``, /v1/completions
    with ``n``."""
    with daemon(tmp_path, upstream=upstream_config(team.url)) as proxy:
        for path, body in (
            ("/infill", {**FIM_BODY, "n_cmpl": 2, "stream": True}),
            ("/completion", {**LONG, "n_predict": 6, "n_cmpl": 3, "stream": True}),
        ):
            events = sse_objects(httpx.post(proxy.url + path, json=body, timeout=60).text)
            assert all("error" not in e for e in events), events
            finals = sorted(e["index"] for e in events if e["stop"])
            assert finals == list(range(body["n_cmpl"])), events
            assert {e["index"] for e in events if not e["stop"]} == set(finals)
        body = {"prompt": "def f():\n", "max_tokens": 6, "n": 2, "stream": True}
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
        assert r.text.rstrip().endswith("data: [DONE]")
        chunks = [c for e in sse_objects(r.text) for c in e.get("choices", [])]
        assert sorted(c["index"] for c in chunks if c["finish_reason"]) == [0, 1], chunks


def test_a_bad_body_gets_the_local_routes_400_and_never_goes_upstream(
    team: Daemon, tmp_path: Path
) -> None:
    with daemon(tmp_path, upstream=upstream_config(team.url)) as proxy:
        before = [e for e in team.requests() if e.get("method") == "POST"]
        for path, raw in BAD_BODIES:
            r = httpx.post(
                proxy.url + path, content=raw, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == 400 and err["type"] == "invalid_request_error", err
            assert err["message"].startswith("Invalid request"), err
            assert r.headers["x-localspec-backend"] == "none"
        ok = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
        assert ok.status_code == 200 and ok.headers["x-localspec-backend"] == "upstream"
        team.lines("/infill", n=len([e for e in before if e.get("path") == "/infill"]) + 1)
        after = [e for e in team.requests() if e.get("method") == "POST"]
        assert len(after) == len(before) + 1  # only the good request reached the team server
        assert all(line["status"] == 400 for line in proxy.lines("/completion"))


def test_the_editor_leaving_stops_the_upstream_at_once(team: Daemon, tmp_path: Path) -> None:
    with daemon(tmp_path, upstream=upstream_config(team.url)) as proxy:
        # streamed: the editor reads one event and closes the connection
        with httpx.stream(
            "POST", proxy.url + "/completion", json={**LONG, "stream": True}, timeout=60
        ) as s:
            next(s.iter_raw())
        assert wait_for(lambda: _quiet(team.url), 10, "the team server stops generating") < 5
        # not streamed: the editor gives up waiting (llama-vscode aborts on the next key),
        # once the team server works on it (a timeout of its own could fire before the
        # request got there on a loaded machine, or after the answer on a fast one)
        payload = json.dumps(LONG).encode()
        head = (
            f"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(head + payload)
            wait_for(lambda: _working(team.url), 30, "the team server works on it")
        assert wait_for(lambda: _quiet(team.url), 10, "the team server stops generating") < 5
        outcomes = [e["outcome"] for e in team.lines("/completion", 2)]
        assert outcomes.count("client left") >= 2


def test_a_refused_key_is_a_clear_401(qwen_target: Path, tmp_path: Path) -> None:
    with daemon(tmp_path, model=str(qwen_target), api_key="team-key") as locked:
        config = upstream_config(locked.url, api_key="wrong-key")
        with daemon(tmp_path, upstream=config, api_key="editor-key") as proxy:
            editor = {"Authorization": "Bearer editor-key"}
            r = httpx.post(proxy.url + "/infill", json=FIM_BODY, headers=editor, timeout=60)
            assert r.status_code == 401
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == 401
            assert f"the upstream {locked.url} refuses localspec's key" in err["message"]
            p = httpx.get(proxy.url + "/props", headers=editor).json()  # needs the key too
            assert p["error"]["code"] == 401 and p["backend"]["status"] == "refused"
            assert "refuses localspec's key" in p["backend"]["error"]
            state = httpx.get(proxy.url + "/health").json()
            assert state == {"status": "ok"}  # it answers: the 401 is how the key shows
            metrics = httpx.get(proxy.url + "/metrics", headers=editor).text
            assert 'errors_total{backend="upstream",route="/infill",status="401"} 1.0' in metrics
            assert "localspec_backend_answers_total{" not in metrics  # an error, no answer
        # the right key: the editor's own key never goes upstream, localspec's does
        with daemon(tmp_path, upstream=upstream_config(locked.url, api_key="team-key")) as ok:
            r = httpx.post(ok.url + "/infill", json=FIM_BODY, headers={"Authorization": "Bearer x"})
            assert r.status_code == 200, r.text


@contextlib.contextmanager
def mortal_team(model: Path, tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    """A team server this test may kill, and a proxy in front of it with the same model as
    its local fallback (loaded)."""
    team = launch(tmp_path, model=str(model), n_ctx=8192)
    try:
        config = upstream_config(team.url, health_interval_s=5.0)
        with daemon(tmp_path, model=str(model), upstream=config, alias="local") as proxy:
            wait_local(proxy)
            yield team, proxy
    finally:
        team.kill()


def test_killed_mid_stream_then_the_local_model_answers(qwen_target: Path, tmp_path: Path) -> None:
    with mortal_team(qwen_target, tmp_path) as (team, proxy):
        with httpx.stream(
            "POST", proxy.url + "/completion", json={**LONG, "stream": True}, timeout=60
        ) as s:
            chunks = s.iter_raw()
            data = next(chunks)
            team.kill()
            data += b"".join(chunks)
        events = sse_objects(data.decode())
        assert events[0]["stop"] is False and "content" in events[0]
        assert events[-1]["error"]["type"] == "unavailable_error"
        assert events[-1]["error"]["code"] == 503
        assert "closed the connection" in events[-1]["error"]["message"]
        # the next keystroke: the local model answers at once, no error
        t0 = time.monotonic()
        r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["model"] == "local"
        assert took < 5
        p = props(proxy.url)
        assert p["backend"]["answering"] == "local" and p["backend"]["status"] == "down"
        assert p["model_alias"] == "local"
        last = proxy.lines("/infill")[-1]
        assert last["backend"] == "local" and last["fallback"] == "down"


def test_killed_mid_answer_the_local_model_answers_instead(
    qwen_target: Path, tmp_path: Path
) -> None:
    with mortal_team(qwen_target, tmp_path) as (team, proxy):
        result: dict[str, Any] = {}

        def ask() -> None:
            body = {**FIM_BODY, "n_predict": 6000}
            result["r"] = httpx.post(proxy.url + "/infill", json=body, timeout=120)

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(
            lambda: any(s["is_processing"] for s in httpx.get(team.url + "/slots").json()),
            30,
            "the team server works on it",
        )
        team.kill()
        asker.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "local"  # answered in full by the local model
        line = proxy.lines("/infill")[0]
        assert line["backend"] == "local" and line["fallback"] == "closed"


def test_failover_while_down_and_back_when_it_returns(qwen_target: Path, tmp_path: Path) -> None:
    port = free_port()
    team = launch(tmp_path, model=str(qwen_target), port=port)
    config = upstream_config(f"http://127.0.0.1:{port}", health_interval_s=0.5)
    try:
        with daemon(tmp_path, model=str(qwen_target), upstream=config, alias="local") as proxy:
            wait_local(proxy)

            def who() -> str:
                r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
                assert r.status_code == 200, r.text
                by = "local" if r.json()["model"] == "local" else "upstream"
                assert r.headers["x-localspec-backend"] == by
                return by

            assert who() == "upstream"
            team.kill()
            answers = [who() for _ in range(5)]  # every request answered, by the local model
            assert answers == ["local"] * 5
            team = launch(tmp_path, model=str(qwen_target), port=port)
            back = wait_for(lambda: who() == "upstream", 30, "answers come from upstream again")
            assert back < 10
            metrics = httpx.get(proxy.url + "/metrics").text
            assert 'localspec_backend_fallbacks_total{reason="down"}' in metrics
            p = props(proxy.url)["backend"]
            assert p["answered"]["local"] >= 5 and p["answered"]["upstream"] >= 2
    finally:
        team.kill()


def test_without_a_local_model_a_down_upstream_is_a_clear_503(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with daemon(tmp_path, upstream=upstream_config(dead), ready=False) as proxy:
        wait_for(lambda: _answers(proxy.url + "/health"), 30, "the proxy listens")
        health = httpx.get(proxy.url + "/health")
        assert health.status_code == 503
        r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=30)
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "unavailable_error"
        assert f"the upstream {dead} is down" in err["message"]
        assert "unreachable" in err["message"] and "backend.fallback = none" in err["message"]
        metrics = httpx.get(proxy.url + "/metrics").text  # answered while nothing else is
        assert 'localspec_http_requests_total{route="/infill",status="503"} 1.0' in metrics
        assert "localspec_backend_answers_total{" not in metrics


def test_a_request_nobody_could_answer_is_counted_as_such(
    qwen_target: Path, tmp_path: Path
) -> None:
    """The team server dies between two health checks, and no local model stands in: the
    request's 503 is counted under backend "none", not as anybody's answer."""
    team = launch(tmp_path, model=str(qwen_target))
    try:
        config = upstream_config(team.url, health_interval_s=60.0)
        with daemon(tmp_path, upstream=config) as proxy:
            assert httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60).status_code == 200
            team.kill()
            r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
            assert r.status_code == 503 and r.headers["x-localspec-backend"] == "none"
            metrics = httpx.get(proxy.url + "/metrics").text
            assert 'errors_total{backend="none",route="/infill",status="503"} 1.0' in metrics
            assert 'answers_total{backend="upstream",route="/infill"} 1.0' in metrics
    finally:
        team.kill()


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.TransportError:
        return False
    return True


def test_a_slow_upstream_gives_way_to_the_local_model(qwen_target: Path, tmp_path: Path) -> None:
    # far later than the local model takes to answer, on a loaded machine too
    slow = Scripted(pieces=["from upstream"], delay_s=6.0)
    with serve_app(slow.app()) as served:
        config = upstream_config(served.url, fallback_ms=300.0, health_interval_s=30.0)
        with daemon(tmp_path, model=str(qwen_target), upstream=config, alias="local") as proxy:
            wait_local(proxy)
            times = []
            for _ in range(4):
                t0 = time.monotonic()
                r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
                times.append(time.monotonic() - t0)
                assert r.status_code == 200 and r.json()["model"] == "local"
            assert max(times) < 5.0  # never waited for the 6 s upstream
            # three late answers in a row: the fourth did not even try the upstream
            assert len(slow.bodies) == 3
            assert [e.get("fallback") for e in proxy.lines("/infill", 4)] == ["slow"] * 4
            assert props(proxy.url)["backend"]["status"] == "slow"


@pytest.mark.parametrize(
    ("kind", "stream", "over", "reason"),
    [
        ("llama-server", False, {"fallback_ms": 1000.0}, "slow"),  # late: given up at 1 s
        ("openai", True, {"status": 503}, "unavailable"),  # failed after 1 s of waiting
    ],
)
def test_the_local_model_gets_what_is_left_of_the_requests_time(
    kind: str, stream: bool, over: dict[str, Any], reason: str, qwen_target: Path, tmp_path: Path
) -> None:
    """D1: the time spent on the upstream counts against the request's ``t_max_predict_ms``:
    the local model answering after it gets what is left, not the whole budget again."""
    status = over.pop("status", 200)
    late = Scripted(pieces=["from upstream"], delay_s=6.0 if status == 200 else 1.0)
    late.status = status
    with serve_app(late.app()) as served:
        config = upstream_config(served.url, kind, health_interval_s=30.0, **over)
        with daemon(tmp_path, model=str(qwen_target), upstream=config, alias="local") as proxy:
            wait_local(proxy)
            body = {**FIM_BODY, "t_max_predict_ms": 60000, "stream": stream}
            r = httpx.post(proxy.url + "/infill", json=body, timeout=60)
            assert r.status_code == 200 and r.headers["x-localspec-backend"] == "local", r.text
            final = sse_objects(r.text)[-1] if stream else r.json()
            assert final["stop"] is True and final["model"] == "local"
            budget = final["generation_settings"]["t_max_predict_ms"]
            # the second spent upstream is gone (the give-up timer may fire a millisecond early)
            assert 0 < budget <= 60000 - 990
            assert proxy.lines("/infill")[-1]["fallback"] == reason


def test_an_untrusted_certificate_is_a_clear_error_and_ca_bundle_fixes_it(
    tmp_path: Path,
) -> None:
    cert, key = self_signed(tmp_path)
    scripted = Scripted(pieces=["ok"])
    with serve_app(scripted.app(), ssl=(cert, key)) as served:
        with daemon(tmp_path, upstream=upstream_config(served.url), ready=False) as proxy:
            wait_for(lambda: _answers(proxy.url + "/health"), 30, "the proxy listens")
            r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=30)
            assert r.status_code == 503
            message = r.json()["error"]["message"]
            assert "TLS certificate localspec does not trust" in message
            assert "backend.ca_bundle" in message
            assert scripted.bodies == []  # nothing was sent over the untrusted connection
        config = upstream_config(served.url, ca_bundle=str(cert))
        with daemon(tmp_path, upstream=config) as proxy:
            r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=30)
            assert r.status_code == 200 and r.json()["content"] == "ok"
            assert json.loads(json.dumps(scripted.bodies[-1]))["id_slot"] == stable_slot(
                4, workstation()
            )


def test_chat_is_kept_off_the_workstations_fim_slot(tmp_path: Path) -> None:
    """D3: the stable slot holds this editor's ring of files; a chat request relayed with it
    would evict that cache on the team server. Chat goes with ``id_slot`` -1 (the server
    picks), whatever the editor sent; completions keep the stable slot."""
    team = Scripted(pieces=["a"])  # llama-server-style: /props says 4 slots
    with (
        serve_app(team.app()) as served,
        daemon(tmp_path, upstream=upstream_config(served.url)) as proxy,
    ):
        wait_for(lambda: props(proxy.url)["backend"]["upstream_slots"] == 4, 10, "4 slots")
        slot = stable_slot(4, workstation())
        r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=60)
        assert r.status_code == 200 and team.bodies[-1]["id_slot"] == slot
        for id_slot in ({}, {"id_slot": slot}):
            chat = {"messages": [{"role": "user", "content": "hi"}], **id_slot}
            r = httpx.post(proxy.url + "/v1/chat/completions", json=chat, timeout=60)
            assert r.status_code == 200, r.text
            assert team.bodies[-1]["id_slot"] == -1

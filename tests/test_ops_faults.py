"""Faults: clients leaving mid-prefill, mid-generation and mid-stream (the next request is
served correctly from the cache), bad model files and a busy port at start, SIGTERM while
streaming."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localspec.engine.types import EngineSettings, ModelSettings
from localspec.server import ServerSettings, logs, serve
from localspec.server.run import EXIT_BIND_FAILED, EXIT_LOAD_FAILED
from tests.ops_support import (
    Live,
    engine_settings,
    launch,
    running_daemon,
    start,
    stop,
    wait_until,
)
from tests.steer import held_generation, held_prefill

N_CTX = 2048
CODE = "".join(f"def handler_{i}(event, context):\n    return event['k{i}']\n\n" for i in range(90))


@pytest.fixture(scope="module")
def live(qwen_target: Path) -> Iterator[Live]:
    # small batches: the prompt takes many decode calls, so an abort can land mid-prefill
    server = start(
        ServerSettings(port=0),
        engine_settings(qwen_target, n_ctx=N_CTX, n_batch=32, n_slots=1),
    )
    yield server
    stop(server)


def greedy(prompt: str, n_predict: int, **over: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": n_predict, "top_k": 1, "samplers": ["top_k"],
            "id_slot": 0}  # fmt: skip
    body.update(over)
    return body


def wait_idle(live: Live, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not live.service.worker.busy and live.service.worker.queued == 0:
            return
        time.sleep(0.01)
    raise AssertionError("a slot stayed busy")


def abort_running(live: Live, body: dict[str, Any], held: Any) -> None:
    """Send ``body`` on a raw socket and close it once the engine waits at the ``held`` hold
    (mid-prefill or mid-generation, as the test put it: on any machine)."""
    raw = json.dumps(body).encode()
    host, port = live.url.removeprefix("http://").split(":")
    head = (
        f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode()
    with held(live.service.worker.engine) as hold:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + raw)
            hold.wait_reached()
        wait_idle(live)  # the client left: the hold lets go once the worker cancels the job


def abort_stream(live: Live, body: dict[str, Any]) -> None:
    """Read the first streamed token, then leave (the generation waits there until then)."""
    with held_generation(live.service.worker.engine):
        with (
            httpx.Client(base_url=live.url, timeout=60) as c,
            c.stream("POST", "/completion", json={**body, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        wait_idle(live)  # the client left: the hold lets go once the worker cancels the job


def test_client_leaving_mid_prefill_generation_or_stream_leaves_a_good_cache(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=logs.REQUESTS)
    worker = live.service.worker
    with live.client() as c:
        reference = c.post("/completion", json=greedy(CODE, 12, cache_prompt=False, n_probs=2))
        reference = reference.json()
        assert reference["timings"]["prompt_n"] > 1000 and reference["tokens_predicted"] == 12
        # the answer from a reused cache is compared token for token: the premise is that no
        # choice in it is close enough for batch-split rounding (~1e-4) to turn it, on any CPU
        top = [e["top_logprobs"] for e in reference["completion_probabilities"]]
        assert min(t[0]["logprob"] - t[1]["logprob"] for t in top) > 0.05, top

        for case in ("prefill", "generation", "stream"):
            c.post("/completion", json=greedy("x", 1, cache_prompt=False))  # empty the cache
            cancelled = worker.n_cancelled
            seen = len(caplog.records)
            if case == "prefill":  # the prompt is 1.5k tokens in batches of 32: held after one
                abort_running(live, greedy(CODE + "# more\n", 8), held_prefill)
            elif case == "generation":
                c.post("/completion", json=greedy(CODE, 0))  # prefill done
                abort_running(live, greedy(CODE, 100_000), held_generation)
            else:
                abort_stream(live, greedy(CODE, 100_000))
            wait_idle(live)
            # counted (and logged) just after the slot is free: the test can look first
            wait_until(lambda cancelled=cancelled: worker.n_cancelled == cancelled + 1)
            cached = c.get("/slots").json()[0]["n_prompt_tokens"]
            if case == "prefill":
                # nobody else waited: the left prompt was evaluated to its end (the next
                # keystroke's head) and nothing was generated for it
                def engine_stopped(seen: int = seen) -> list[dict[str, Any]]:
                    return [
                        r.fields  # type: ignore[attr-defined]
                        for r in caplog.records[seen:]
                        if getattr(r, "fields", {}).get("outcome") == "engine stopped"
                    ]

                wait_until(engine_stopped)  # logged once the engine let go: the test can be first
                stopped = engine_stopped()
                assert stopped[-1]["predicted"] == 0, "never left during the prompt"
                assert stopped[-1]["evaluated"] == stopped[-1]["n_prompt"] == cached
                assert cached > reference["tokens_evaluated"]
            again = c.post("/completion", json=greedy(CODE, 12)).json()
            assert again["content"] == reference["content"], case
            assert again["tokens"] == reference["tokens"], case
            assert again["timings"]["cache_n"] > 0, case  # the kept part was reused
            assert again["timings"]["prompt_n"] < reference["timings"]["prompt_n"], case
    # each abort is logged as such: 499 for a plain answer, a 200 cut short for a stream
    left = [r.fields for r in caplog.records if r.name == logs.REQUESTS]  # type: ignore[attr-defined]
    left = [f for f in left if f["outcome"] == "client left"]
    assert {f["status"] for f in left} == {499, 200} and len(left) >= 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_queued_is_a_499_not_a_503(
    live: Live, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """Dropped from the queue because its client left: logged and counted as the client
    leaving, never as the 503 of a full queue or a superseded request (alerts on 503s)."""
    caplog.set_level(logging.INFO, logger=logs.REQUESTS)
    worker = live.service.worker
    host, port = live.url.removeprefix("http://").split(":")
    raw = json.dumps({**greedy("def f():", 8), "stream": stream}).encode()
    head = (
        f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode()
    with held_generation(worker.engine) as hold, httpx.Client(base_url=live.url, timeout=60) as c:
        body = {**greedy(CODE, 100_000), "stream": True}
        running = c.build_request("POST", "/completion", json=body)
        sent = c.send(running, stream=True)  # holds the only slot
        hold.wait_reached()
        cancelled = worker.n_cancelled
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + raw)
            wait_until(lambda: worker.queued == 1)
        wait_until(lambda: worker.queued == 0 and worker.n_cancelled == cancelled + 1)
        worker.cancel_running()
        sent.close()
    wait_idle(live)

    def statuses() -> list[Any]:
        return [getattr(r, "fields", {}).get("status") for r in caplog.records
                if r.name == logs.REQUESTS]  # fmt: skip

    wait_until(lambda: 499 in statuses())  # logged once its handler returns
    assert 503 not in statuses(), statuses()
    metrics = httpx.get(live.url + "/metrics").text
    assert 'localspec_http_requests_total{route="/completion",status="503"}' not in metrics


# ---------------------------------------------------------------------- start-up faults


@pytest.mark.parametrize("kind", ["missing", "truncated", "not GGUF"])
def test_bad_model_file_at_start_is_a_clear_error_and_non_zero_exit(
    kind: str, qwen_target: Path, tmp_path: Path
) -> None:
    path = tmp_path / f"{kind.replace(' ', '-')}.gguf"
    if kind == "truncated":
        with qwen_target.open("rb") as src:
            path.write_bytes(src.read(1 << 20))
    elif kind == "not GGUF":
        path.write_text("<html>404 Not Found</html>\n")
    daemon = launch(model=str(path))
    try:
        out, err = daemon.proc.communicate(timeout=120)
    finally:
        daemon.proc.kill()
    assert daemon.proc.returncode == EXIT_LOAD_FAILED, err[-2000:]
    assert path.name in err and "could not load the model" in err
    assert "READY" not in out and "Traceback" not in err


def test_port_in_use_is_a_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="localspec.server"):
            rc = serve(
                ServerSettings(host="127.0.0.1", port=port),
                EngineSettings(target=ModelSettings(path="unused.gguf")),
            )
    assert rc == EXIT_BIND_FAILED
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"cannot listen on 127.0.0.1:{port}" in message and "already running" in message


def test_sigterm_while_streaming_is_a_graceful_exit(qwen_target: Path) -> None:
    with running_daemon(model=str(qwen_target), n_ctx=N_CTX, n_slots=1) as daemon:
        events: list[str] = []

        def stream() -> None:
            body = greedy("def f():\n", 100_000, stream=True)
            try:
                with httpx.stream("POST", daemon.url + "/completion", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line)
            except httpx.HTTPError:
                events.append("closed")

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(events) >= 3
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=60) == 0
        reader.join(30)
        assert not reader.is_alive()
        assert daemon.read_until("RC") == "0"
        assert all(json.loads(e[6:])["stop"] is False for e in events[:3])

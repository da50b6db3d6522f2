"""``serve`` as the CLI runs it: in its own process, with signals, both loopback addresses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from localspec.server.options import ServerSettings
from localspec.server.run import bind_sockets

SCRIPT = """
import json, sys
from localspec.engine.types import EngineSettings, ModelSettings
from localspec.server import ServerSettings, serve

model = ModelSettings(path=sys.argv[1], n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2,
                      n_threads_batch=2)
rc = serve(
    ServerSettings(port=0),
    EngineSettings(target=model),
    on_ready=lambda: print("READY", flush=True),
    on_bound=lambda addrs: print("BOUND " + json.dumps(addrs), flush=True),
)
print("RC", rc, flush=True)
sys.exit(rc)
"""


def launch(model: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, model],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_until(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise AssertionError(f"process ended before {prefix!r}: {proc.stderr and proc.stderr.read()}")


def test_serves_both_loopbacks_and_stops_cleanly_on_sigterm(qwen_target: Path) -> None:
    proc = launch(str(qwen_target))
    try:
        addrs = json.loads(read_until(proc, "BOUND "))
        read_until(proc, "READY")
        hosts = {a[0] for a in addrs}
        assert "127.0.0.1" in hosts
        port = addrs[0][1]
        for host in hosts:
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            assert httpx.get(url + "/health").json() == {"status": "ok"}
        # a long generation is in flight when the signal comes: it is cancelled, not awaited
        answers: list[int] = []

        def long_request() -> None:
            body = {"prompt": "hello", "n_predict": 100000, "top_k": 1}
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=60)
                answers.append(r.status_code)
            except httpx.TransportError:
                answers.append(-1)

        sender = threading.Thread(target=long_request)
        sender.start()
        for _ in range(200):
            slots = httpx.get(f"http://127.0.0.1:{port}/slots").json()
            if slots[0]["is_processing"]:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        sender.join(60)
        assert answers and answers[0] in (200, -1)
        assert read_until(proc, "RC") == "0"
    finally:
        proc.kill()
        proc.wait()


def test_a_model_that_fails_to_load_stops_with_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    proc = launch(str(missing))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode not in (0, None)
    assert "nope.gguf" in err and "could not load the model" in err
    assert "READY" not in out


def test_non_loopback_without_key_is_refused() -> None:
    from localspec.engine.types import EngineSettings, ModelSettings
    from localspec.server import serve

    with pytest.raises(ValueError, match="API key"):
        serve(ServerSettings(host="0.0.0.0"), EngineSettings(target=ModelSettings(path="x")))


def test_localhost_binds_ipv4_and_ipv6_on_one_port() -> None:
    socks = bind_sockets("localhost", 0)
    try:
        families = {s.family.name for s in socks}
        ports = {s.getsockname()[1] for s in socks}
        assert "AF_INET" in families and len(ports) == 1
    finally:
        for s in socks:
            s.close()


def test_listeners_are_tcp_so_answers_go_out_without_nagle_delay() -> None:
    """asyncio sets TCP_NODELAY only on sockets whose proto is TCP; with proto 0 every answer
    written in two parts (headers, body) waited ~40 ms for a delayed ACK."""
    import socket

    for sock in bind_sockets("localhost", 0):
        try:
            assert sock.proto == socket.IPPROTO_TCP
        finally:
            sock.close()

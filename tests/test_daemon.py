"""Daemon helpers: who holds a port, pid files, readiness polling, stopping, log tailing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from localspec import daemon
from tests.ops_support import http_server


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def localspec_like() -> Iterator[int]:
    with http_server(json.dumps({"build_info": "localspec 0.1.0"}).encode()) as port:
        yield port


@pytest.fixture
def other_http() -> Iterator[int]:
    with http_server(b'{"build_info": "b4000-llama-server"}') as port:
        yield port


def test_free_port_is_free() -> None:
    assert daemon.probe_port("127.0.0.1", _free_port()).kind == "free"


def test_a_localspec_server_is_recognised(localspec_like: int) -> None:
    owner = daemon.probe_port("127.0.0.1", localspec_like)
    assert owner.kind == "localspec"


def test_another_http_server_is_named_with_its_pid(other_http: int) -> None:
    owner = daemon.probe_port("127.0.0.1", other_http)
    assert owner.kind == "other"
    assert "not localspec" in owner.detail
    if owner.pid is not None:  # psutil shows our own sockets on Linux and Windows
        assert owner.pid == os.getpid()
        assert "python" in (owner.name or "").lower() or "pytest" in (owner.name or "")


def test_a_plain_tcp_listener_is_other() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        owner = daemon.probe_port("127.0.0.1", port)
    assert owner.kind == "other"
    assert f"port {port}" in owner.describe() or "HTTP" in owner.describe()


def test_a_host_name_that_does_not_resolve_holds_no_port() -> None:
    # a typo in server.host is the server's bind error to report, not "the port is held"
    assert daemon.probe_port("no-such-host.invalid", _free_port()).kind == "free"


def test_pid_file_roundtrip_and_stale_removal(state_dir: Path) -> None:
    path = daemon.write_pid_file("127.0.0.1", 8123, Path("/tmp/x.log"))
    assert path.parent == state_dir
    # pytest's own process is not a localspec daemon: the file counts as stale
    assert daemon.read_pid_file(8123, check_alive=False).pid == os.getpid()
    assert daemon.read_pid_file(8123) is None
    assert not path.exists()


def test_remove_pid_file_leaves_another_daemons_file(state_dir: Path) -> None:
    path = daemon.pid_file(8124)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 1, "host": "h", "port": 8124, "started": 0}))
    daemon.remove_pid_file(8124)
    assert path.exists()


def test_wait_until_ready_returns_the_exit_code_of_a_dead_child() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    assert daemon.wait_until_ready(f"http://127.0.0.1:{_free_port()}", proc, 30) == 7


def test_wait_until_ready_sees_health(localspec_like: int) -> None:
    ticks: list[str] = []
    url = f"http://127.0.0.1:{localspec_like}"
    assert daemon.wait_until_ready(url, None, 10, ticks.append) == "ready"
    assert ticks == ["ready"]


def test_loading_state_and_timeout() -> None:
    with http_server(b'{"error":{"message":"Loading model"}}', status=503) as port:
        assert daemon.health(f"http://127.0.0.1:{port}")[0] == "loading"
        assert (
            daemon.wait_until_ready(f"http://127.0.0.1:{port}", None, 0.5, interval=0.1)
            == "loading"
        )


def test_spawn_detached_runs_in_its_own_session_and_logs(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "d.log"
    proc = daemon.spawn_detached(["--version"], log)
    assert proc.wait(60) == 0
    assert "localspec" in log.read_text()
    if os.name == "posix":
        assert proc.pid != os.getpgrp()


GRACEFUL = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print("up", flush=True)
time.sleep(60)
"""
STUBBORN = GRACEFUL.replace("lambda *a: sys.exit(0)", "signal.SIG_IGN")


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM semantics")
def test_stop_sends_sigterm_and_waits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", GRACEFUL], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    assert daemon.stop(proc.pid, timeout=30) == "stopped"
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    assert stubborn.stdout.readline() == b"up\n"
    assert daemon.stop(stubborn.pid, timeout=0.5) == "timeout"
    assert daemon.stop(stubborn.pid, timeout=0.5, force=True) == "killed"
    assert daemon.stop(stubborn.pid) == "gone"


def test_tail_and_follow(tmp_path: Path) -> None:
    log = tmp_path / "l.log"
    log.write_text("".join(f"line {i}\n" for i in range(5000)))
    assert daemon.tail(log, 3) == ["line 4997", "line 4998", "line 4999"]
    assert daemon.tail(tmp_path / "missing", 3) == []
    follower = daemon.follow(log, interval=0.05)
    got: list[str] = []
    thread = threading.Thread(
        target=lambda: got.extend([next(follower), next(follower)]), daemon=True
    )
    thread.start()
    with open(log, "a") as fh:
        fh.write("new 1\nnew 2\n")
    thread.join(10)
    assert got == ["new 1", "new 2"]


def test_base_url_for_wildcard_and_ipv6() -> None:
    assert daemon.base_url("0.0.0.0", 8012) == "http://127.0.0.1:8012"
    assert daemon.base_url("::1", 8012) == "http://[::1]:8012"
    assert daemon.base_url("localhost", 1) == "http://localhost:1"

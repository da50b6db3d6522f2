"""The team-backend benchmarks on the editor replay: a localspec proxy's added latency, and a
team server killed and started again mid-replay (every request still answered)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from localspec.bench import proxy
from localspec.bench.driver import Outcome
from localspec.bench.replay import main as replay_main
from tests.test_bench_replay import _write_code


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_code(tmp_path_factory.mktemp("code"))


def _out(server: str, burst: int, key: int, ms: float, **kw: object) -> Outcome:
    o = Outcome(server, burst, key, "type", "ok", ms)
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def test_overhead_is_latency_minus_the_upstreams_round_trip() -> None:
    outcomes = [
        _out("direct", 0, 0, 100.0),
        _out("direct", 0, 1, 50.0),
        _out(proxy.PROXY, 0, 0, 103.0, server_timing={"upstream": 101.0}),
        _out(proxy.PROXY, 0, 1, 58.0, server_timing={"upstream": 55.0}),
        _out(proxy.PROXY, 1, 0, 10.0, status="aborted"),
    ]
    o = proxy.overhead(outcomes, direct="direct")
    assert o.n == 2 and o.hop_p50_ms == pytest.approx(2.5) and o.hop_max_ms == 3.0
    assert o.paired_n == 2 and o.paired_p50_ms == pytest.approx(5.5)
    assert o.met and "met" in proxy.overhead_table(o)


def _replay(model: Path, code: Path, tmp_path: Path, mode: str, locations: int) -> Any:
    """A short greedy replay in ``mode`` (--via-proxy, --failover); its JSON."""
    out = tmp_path / "replay.json"
    argv = ["--target", str(model), "--code", str(code), "--ctx", "2048", "--threads", "1",
            "--locations", str(locations), "--max-keys", "2", "--greedy", "--cold", "none",
            mode, "--json", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet"]  # fmt: skip
    assert replay_main(argv) == 0
    return json.loads(out.read_text())


def test_a_short_replay_through_the_proxy(
    qwen_target: Path, code_dir: Path, tmp_path: Path
) -> None:
    doc = _replay(qwen_target, code_dir, tmp_path, "--via-proxy", 2)
    assert [s["server"] for s in doc["summaries"]] == ["localspec", "proxy"]
    assert all(s["errors"] == 0 for s in doc["summaries"])
    added = doc["proxy_overhead"]
    assert added["n"] >= 2 and added["hop_p50_ms"] is not None and added["hop_p50_ms"] >= 0
    answered = [
        r
        for r in doc["requests"]
        if r["server"] == "proxy" and r["status"] == "ok" and r["kind"] != "meter"
    ]
    assert answered and all(r["backend"] == "upstream" for r in answered)
    argv_proxy = next(s["argv"] for s in doc["servers"] if s["name"] == "proxy")
    assert "backend.kind=llama-server" in argv_proxy and "backend.slot=1" in argv_proxy


def test_a_replay_while_the_team_server_dies_and_returns(
    qwen_target: Path, code_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the proxy falls back only when the team server is gone, not when a busy machine makes
    # it answer later than the default 2 s: the phases are then the killing's alone
    monkeypatch.setenv("LOCALSPEC_BACKEND_FALLBACK_MS", "0")
    doc = _replay(qwen_target, code_dir, tmp_path, "--failover", 4)
    failover = doc["failover"]
    assert failover["every_request_answered"] is True
    up, down, back = failover["phases"]
    assert up["errors"] == down["errors"] == back["errors"] == 0
    assert up["by"].get("upstream", 0) >= 1 and not up["by"].get("local")
    assert down["by"].get("local", 0) >= 1 and not down["by"].get("upstream")
    assert back["by"].get("upstream", 0) >= 1
    assert failover["back_s"] is not None and failover["back_s"] < 10

"""Load: editor-like clients on loopback mixing /infill, warm-ups and aborts against the daemon
in its own process (as ``localspec up`` runs it). No crash, no deadlock, bounded RSS, no slot
left busy, every completed greedy answer equal to the same request run alone."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from localspec.bench.load import LoadReport, infill_bodies, run_load
from tests.ops_support import running_daemon

N_CTX = 2048


def check(report: LoadReport, daemon_alive: bool) -> None:
    print("\n" + report.table())
    assert daemon_alive, "the daemon died under load"
    assert report.errors == 0, report.error_samples
    assert report.mismatches == 0, report.error_samples
    assert report.completed > report.clients, "too few requests completed to mean anything"
    assert report.aborted > 0 and report.warmups > 0
    assert report.busy_slots_after == 0 and report.queue_after == 0
    assert report.rss_growth < 0.05, (report.rss_before_mb, report.rss_after_mb)
    assert set(report.status) <= {"200", "503"}, report.status


def assert_no_close_calls(url: str) -> None:
    """The premise of "equal to the same request run alone": under load an answer is computed
    beside other requests (other batch splits, other KV cells: rounding of ~1e-4), so no choice
    in the answers may be a closer call than that, on any CPU."""
    with httpx.Client(base_url=url, timeout=120) as c:
        for body in infill_bodies(6, 8):  # run_load's requests
            r = c.post("/infill", json={**body, "n_probs": 2, "cache_prompt": False})
            top = [e["top_logprobs"] for e in r.json()["completion_probabilities"]]
            assert min(t[0]["logprob"] - t[1]["logprob"] for t in top) > 0.05, top


def load(model: Path, clients: int, seconds: float, tmp_path: Path) -> None:
    with running_daemon(
        model=str(model), n_ctx=N_CTX, n_batch=512, n_slots=4, queue_limit=8
    ) as daemon:
        assert_no_close_calls(daemon.url)
        shown: list[str] = []
        report = run_load(daemon.url, clients=clients, seconds=seconds, progress=shown.append)
        alive = daemon.proc.poll() is None
        (tmp_path / "load.json").write_text(json.dumps(report.__dict__, indent=2))
    check(report, alive)
    # the reference answers take a while on a big model: each is announced before it runs
    assert shown[:6] == [f"  reference answer {n}/6, each request alone ..." for n in range(1, 7)]


def test_16_clients_for_15_seconds(qwen_target: Path, tmp_path: Path) -> None:
    load(qwen_target, clients=16, seconds=15, tmp_path=tmp_path)


@pytest.mark.slow
def test_soak_32_clients_for_60_seconds(qwen_target: Path, tmp_path: Path) -> None:
    load(qwen_target, clients=32, seconds=60, tmp_path=tmp_path)

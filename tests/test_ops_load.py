"""Load: editor-like clients on loopback mixing /infill, warm-ups and aborts against the daemon
in its own process (as ``localspec up`` runs it). No crash, no deadlock, bounded RSS, no slot
left busy, every completed greedy answer equal to the same request run alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.bench.load import LoadReport, run_load
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


def load(model: Path, clients: int, seconds: float, tmp_path: Path) -> None:
    with running_daemon(
        model=str(model), n_ctx=N_CTX, n_batch=512, n_parallel=4, queue_limit=8
    ) as daemon:
        report = run_load(daemon.url, clients=clients, seconds=seconds)
        alive = daemon.proc.poll() is None
        (tmp_path / "load.json").write_text(json.dumps(report.__dict__, indent=2))
    check(report, alive)


def test_16_clients_for_15_seconds(qwen_target: Path, tmp_path: Path) -> None:
    load(qwen_target, clients=16, seconds=15, tmp_path=tmp_path)


@pytest.mark.slow
def test_soak_32_clients_for_60_seconds(qwen_target: Path, tmp_path: Path) -> None:
    load(qwen_target, clients=32, seconds=60, tmp_path=tmp_path)

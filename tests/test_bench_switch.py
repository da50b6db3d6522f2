"""``bench switch`` on a real fixture model, with real daemons: two editors on one slot and a
restart, host cache and kept contexts on vs off. Asserts what it measures, not timings: the
figures are written, and only the "before" daemon evaluates a switched context again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.bench import switch


@pytest.mark.slow
def test_switch_bench_writes_both_daemons_figures(qwen_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "switch.json"
    argv = ["--target", str(qwen_target), "--rounds", "1", "--keys", "2", "--ctx", "2048",
            "--threads", "1", "--json", str(out)]  # fmt: skip
    assert switch.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(switch.VARIANTS)
    for kinds in results.values():
        assert kinds["switch"]["n"] == 2 and kinds["warm"]["n"] == 2
        assert kinds["restart"]["n"] == 2 and kinds["all"]["p95_ms"] > 0
    now, before = results["localspec"], results["localspec/before"]
    # a switch and a restart evaluate the editor's context again only without the caches
    for kind in ("switch", "restart"):
        assert before[kind]["evaluated_tokens"] > 500 > now[kind]["evaluated_tokens"], kind

"""``python -m localspec.bench.kvcompact``: the file-switch sequence, compaction on and off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.bench import kvcompact


def test_scenario_moves_a_run_to_the_front_then_evicts_a_chunk() -> None:
    tokens = list(range(10_000))
    sc = kvcompact.scenario(tokens, 4096)
    assert len(sc["cached"]) == 3886
    run = sc["cached"][2071 : 2071 + 743]
    assert sc["warm_up"][2 : 2 + 743] == run and len(sc["warm_up"]) == 1771
    assert sc["final"][: 743 + 2 - 320] == sc["warm_up"][320 : 2 + 743]
    assert sc["keystrokes"] == sc["final"][: 1449 + 512]
    new = set(sc["warm_up"][745:]) | set(sc["final"][-637:]) | set(sc["decode"])
    assert not new & set(sc["cached"])  # fresh text, never reusable
    with pytest.raises(ValueError, match="tokens of source text"):
        kvcompact.scenario(tokens[:5000], 4096)


def test_report_compares_both_modes_on_a_real_model(
    qwen_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kv.json"
    argv = ["--model", str(qwen_target), "--ctx", "1024", "--repeats", "2", "--threads", "2"]
    assert kvcompact.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["compactions_per_run"]["off"] == 0
    assert report["compactions_per_run"]["on"] >= 1
    assert [r["phase"] for r in report["phases"]] == [*kvcompact.PHASES, "total"]
    for row in report["phases"]:
        assert row["off_ms"] > 0 and row["on_ms"] > 0
        assert row["ratio"] == pytest.approx(row["on_ms"] / row["off_ms"])
    assert len(report["runs"]["on"]) == len(report["runs"]["off"]) == 2
    printed = capsys.readouterr()
    assert "end-of-line prefill" in printed.out and "on/off" in printed.out
    assert "repeat 2/2" in printed.err


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        kvcompact.main(["--model", str(tmp_path / "missing.gguf")])

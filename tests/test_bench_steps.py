"""``localspec bench steps`` measures step times on a real model and keeps them for plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec import step_costs
from localspec.bench.steps import main


def test_steps_are_measured_and_kept_for_the_plan(
    qwen_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCALSPEC_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "steps.json"
    argv = ["--target", str(qwen_target), "--model", "tiny", "--quant", "F32",
            "--batches", "1,3", "--kv-tokens", "64", "--steps", "2", "--threads", "1",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["ms_by_sequences"]) == {"1", "3"}
    assert all(ms > 0 for ms in doc["ms_by_sequences"].values())
    from localspec import hardware

    kept = step_costs.load(hardware.probe().description)
    costs = kept[("tiny", "F32")]
    assert set(costs.ms_by_tokens) == {1, 3} and costs.kv_tokens == 64
    assert "localspec bench steps" in costs.source


def test_a_file_outside_the_catalog_is_measured_but_not_kept(
    qwen_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCALSPEC_STATE_DIR", str(tmp_path / "state"))
    argv = ["--target", str(qwen_target), "--batches", "1", "--kv-tokens", "16", "--steps", "1"]
    assert main(argv) == 0
    assert not step_costs.store_path().exists()
    assert main(["--target", str(tmp_path / "missing.gguf")]) == 2

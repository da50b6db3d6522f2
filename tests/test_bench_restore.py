"""``bench restore`` on a real fixture model: the table, the JSON, a restored slot checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.bench import restore


def test_restore_bench_writes_its_rows(
    qwen_target: Path, qwen_draft: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "restore.json"
    argv = ["--target", str(qwen_target), "--draft", str(qwen_draft), "--tokens", "64,128",
            "--ctx", "512", "--threads", "1", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert restore.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 128]
    # the state grows with the context (both models' KV cells)
    assert 0 < rows[0]["state_bytes"] < rows[1]["state_bytes"]
    assert all(r["prefill_ms"] > 0 and r["put_ms"] > 0 for r in rows)
    assert "prefill/put" in capsys.readouterr().out

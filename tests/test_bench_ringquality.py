"""The ring-attention quality benchmark: sampling, scoring and the summary's arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.bench import ringquality
from localspec.bench.corpus import stdlib_files


def test_samples_take_the_ring_from_above_the_prefix_and_score_what_follows() -> None:
    files = stdlib_files()
    picked = ringquality.samples(
        files, 5, seed=1, prefix_lines=30, next_lines=8, same_file=3, other_files=1,
        chunk_lines=32,
    )  # fmt: skip
    assert len(picked) == 5
    texts = {p.name: p.read_text(errors="replace") for p in files}
    for s in picked:
        name, line = s.name.rsplit(":", 1)
        text = texts[name]
        assert (s.prefix + s.continuation) in text + "\n"  # the next lines follow the prefix
        same = [c for c in s.ring if c.filename == name]
        assert len(same) == 3 and len(s.ring) == 4
        cursor_at = text.index(s.prefix + s.continuation)
        assert all(text.index(c.text) + len(c.text) <= cursor_at for c in same)
        assert int(line) > 30


def test_summary_reports_the_share_of_the_rings_gain_each_mode_keeps() -> None:
    rows = [
        {"no ring": 2.0, "causal ring": 1.0, "causal, rotated": 1.5, "block ring": 1.2,
         "block, rotated": 1.2, "sink blocks": 1.6},
        {"no ring": 3.0, "causal ring": 2.0, "causal, rotated": 2.1, "block ring": 1.9,
         "block, rotated": 1.9, "sink blocks": 2.0},
    ]  # fmt: skip
    summary = ringquality.summarize(rows)
    assert summary["ring gain (no ring - causal)"][0] == pytest.approx(1.0)
    assert summary["block ring - causal ring"][0] == pytest.approx(0.05)
    assert summary["share of the ring's gain kept: block ring"] == pytest.approx(0.95)
    assert summary["share of the ring's gain kept: causal, rotated"] == pytest.approx(0.7)
    assert summary["samples where block, rotated beat causal, rotated"] == 2
    assert summary["samples where sink blocks beat causal, rotated"] == 1
    assert "block, rotated" in ringquality.table(summary)


def test_a_short_run_on_the_tiny_model_writes_json(qwen_target: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    argv = ["--model", str(qwen_target), "--samples", "2", "--prefix-lines", "10",
            "--max-tokens", "8", "--same-file", "2", "--other-files", "1", "--chunk-lines", "32",
            "--json", str(out)]  # fmt: skip
    assert ringquality.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["samples"] == 2 and len(doc["rows"]) == 2
    for row in doc["rows"]:
        assert row["n_cont"] == 8 and row["n_ring"] > 0
        # random weights: the three layouts still score differently, and finitely
        assert all(0 < row[m] < 50 for m in ringquality.MODES)
        assert len({row[m] for m in ("no ring", "causal ring", "block ring")}) == 3
        # a rotation moves blocks exactly (up to rounding), a causal ring approximately
        block_error = abs(row["block, rotated"] - row["block ring"])
        assert block_error < 1e-2
        assert abs(row["causal, rotated"] - row["causal ring"]) > 10 * block_error

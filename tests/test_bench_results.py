"""Result files: every benchmark run leaves one, and the doc's tables are rendered from them."""

from __future__ import annotations

import json
from pathlib import Path

from localspec import cli
from localspec.bench import harness, render

DOC = """# Benchmarks

<!-- results:replay -->
stale text
<!-- /results:replay -->

<!-- results:steps -->
<!-- /results:steps -->
"""


def test_a_result_file_holds_what_repeats_and_judges_the_run(_results_elsewhere: Path) -> None:
    path = harness.record("replay", ["--target", "t.gguf", "--locations", "2"], "a  b\n1  2\n",
                          {"p50_ms": 12.5})  # fmt: skip
    assert path.parent == _results_elsewhere / "replay"
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "replay"
    assert doc["command"] == "localspec bench replay --target t.gguf --locations 2"
    assert doc["figures"] == {"p50_ms": 12.5}
    assert doc["table"] == {"text": "a  b\n1  2"}
    assert doc["date"].startswith("20") and doc["date"].endswith("+00:00")
    assert doc["commit"] == "unknown" or len(doc["commit"].removesuffix("+dirty")) == 40
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["python"]


def test_json_flag_still_gets_the_figures_alone(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "figures.json"
    harness.record("steps", [], "t", {"ms_by_sequences": {"1": 2.0}}, json_path=out)
    assert json.loads(out.read_text()) == {"ms_by_sequences": {"1": 2.0}}


def test_render_shows_the_newest_run_and_says_where_none_is(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for name, date, rows in [("old.json", "2026-12-01", [["p50", "9"]]),
                             ("new.json", "2026-12-03T10:00:00+00:00", [["p50", "7"]]),
                             ("notable.json", "2026-12-09", None)]:  # fmt: skip
        doc = {"benchmark": "replay", "date": date, "commit": "abc1234", "command": "unknown"}
        if rows is not None:
            doc["table"] = {"columns": ["figure", "ms"], "rows": rows}
        (results / "replay").mkdir(parents=True, exist_ok=True)
        (results / "replay" / name).write_text(json.dumps(doc))
    out = render.render(DOC, results, tmp_path)
    assert "stale text" not in out
    assert "| p50 | 7 |" in out and "| p50 | 9 |" not in out
    assert "`results/replay/new.json`, date 2026-12-03T10:00:00+00:00, commit abc1234" in out
    assert "_No current table yet: run `localspec bench steps`._" in out
    assert render.render(out, results, tmp_path) == out  # rendering twice changes nothing


def test_render_command_checks_and_writes_the_doc(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    results = tmp_path / "results"
    harness_args = ["--doc", str(doc), "--results", str(results)]
    assert cli.main(["bench", "render", *harness_args, "--check"]) == 1
    assert cli.main(["bench", "render", *harness_args]) == 0
    assert "stale text" not in doc.read_text()
    assert cli.main(["bench", "render", *harness_args, "--check"]) == 0


def test_a_real_benchmark_run_leaves_a_result_that_renders(
    qwen_target: Path, tmp_path: Path, _results_elsewhere: Path, monkeypatch
) -> None:
    """`localspec bench steps` on a real model: its result file repeats the command, holds the
    printed table and the figures, and becomes the doc's current table."""
    monkeypatch.setenv("LOCALSPEC_STATE_DIR", str(tmp_path / "state"))
    argv = ["--target", str(qwen_target), "--batches", "1,2", "--kv-tokens", "16", "--steps", "1"]
    assert cli.main(["bench", "steps", *argv]) == 0
    (path,) = (_results_elsewhere / "steps").glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["command"] == "localspec bench steps " + " ".join(argv)
    assert set(doc["figures"]["ms_by_sequences"]) == {"1", "2"}
    assert doc["table"]["text"].splitlines()[0].split() == ["sequences", "ms", "a", "step",
                                                            "tokens/s"]  # fmt: skip
    out = render.render(DOC, _results_elsewhere, None)
    assert doc["table"]["text"] in out and path.name in out

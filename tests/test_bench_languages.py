"""``localspec bench languages`` end to end on the follow pair (known drafts, fast): files of
each language found on this machine, every mode, the table and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from localspec import cli
from localspec.bench import languages


def test_finds_each_languages_files_on_this_machine() -> None:
    for lang in ("python", "c", "shell"):  # (a machine without JavaScript files is possible)
        files = languages.find_files(lang, 2)
        assert len(files) == 2, lang
        assert all(languages._readable_code(f) for f in files)
    assert all(f.suffix == ".py" for f in languages.find_files("python", 2))


def test_bench_languages_table_and_json(
    qwen_follow: Path, qwen_follow_draft: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "languages.json"
    argv = ["bench", "languages", "--target", str(qwen_follow), "--draft",
            str(qwen_follow_draft), "--files", "1", "--n-predict", "12", "--lines", "12",
            "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["language"], r["mode"]): r for r in result["rows"]}
    langs = [lang for lang, files in result["files"].items() if files] + ["overall"]
    for lang in langs:
        assert {m for (lg, m) in rows if lg == lang} == set(languages.MODES)
        for mode in ("today", "by-context", "agree", "exact-depth"):  # exact: the target's output
            assert rows[(lang, mode)]["identical"] == rows[(lang, mode)]["requests"] > 0
            assert rows[(lang, mode)]["divergence_logit_gaps"] == []
        assert rows[(lang, "target-only")]["drafted"] == 0
        assert rows[(lang, "by-context")]["drafted"] > 0
    assert "by-context" in table and "overall" in table

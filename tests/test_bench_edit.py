"""``localspec bench edit``: its corpus, its report, and a short real run against localspec."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from localspec.bench import edit
from localspec.bench.edittasks import KINDS, edit_tasks
from localspec.bench.speculative import stdlib_files
from localspec.commands.bench import BENCHES


def test_tasks_take_the_four_kinds_in_turn_from_real_functions() -> None:
    tasks = edit_tasks(12, stdlib_files())
    assert [t.kind for t in tasks] == [KINDS[i % 4] for i in range(12)]
    assert len({t.where for t in tasks}) == 12
    assert tasks == edit_tasks(12, stdlib_files())  # deterministic
    for task in tasks:
        fn = ast.parse(task.code).body[0]
        assert isinstance(fn, ast.FunctionDef) and task.where.endswith(":" + fn.name)
        assert 8 <= len(task.code.splitlines()) <= 40
        if task.kind == "convert-loop":
            assert any(isinstance(n, ast.For) for n in ast.walk(fn))
        if task.kind == "rename":
            assert f"`{fn.name}_v2`" in task.instruction
        system, user = task.messages()
        assert system["role"] == "system" and task.code in user["content"]


def test_summary_ratios_and_verdict() -> None:
    a = [
        edit.Answer(edit.PLAIN, 0, "x", n=100, ttft_ms=50, end_ms=2050, decode_ms=2000),
        edit.Answer("localspec/auto", 0, "x", n=100, ttft_ms=40, end_ms=540, decode_ms=500,
                    drafted=90, accepted=80),
        edit.Answer(edit.LLAMA_PLAIN, 0, "y", n=100, ttft_ms=45, end_ms=1545, decode_ms=1500),
        edit.Answer("llama-server/ngram-mod", 0, "z", n=100, ttft_ms=60, end_ms=1060,
                    decode_ms=1000, drafted=50, accepted=25),
    ]  # fmt: skip
    rows = edit.summarize(a, [x.server for x in a])
    by = {r.server: r for r in rows}
    assert by["localspec/auto"].tok_s == pytest.approx(200.0)
    assert by["localspec/auto"].client_tok_s == pytest.approx(99 / 0.5)
    assert by["localspec/auto"].acceptance == pytest.approx(80 / 90)
    assert (by["localspec/auto"].identical, by["localspec/auto"].compared) == (1, 1)
    assert (by["llama-server/ngram-mod"].identical, by["llama-server/ngram-mod"].compared) == (0, 1)
    assert edit.best(rows, "llama-server", plain=True).server == "llama-server/ngram-mod"
    verdict = edit.verdict(rows)
    assert verdict[0].startswith("PASS") and "4.00" in verdict[0]  # 200 vs 50 tok/s
    assert verdict[1].startswith("PASS") and "2.00" in verdict[1]  # 200 vs 100 tok/s
    assert verdict[2].startswith("PASS")  # TTFT 40 ms vs 60 ms
    assert verdict[3] == "PASS localspec/auto answers identical to plain decoding: 1/1"
    assert "localspec/auto" in edit.table(rows)


def test_a_short_real_run_against_localspec(smollm_q4: Path, tmp_path: Path, capsys) -> None:
    """Two localspec daemons (plain decoding, and as it runs by default) answer two edits;
    greedy speculative answers equal the plain ones (by construction), and the JSON holds it."""
    assert "edit" in BENCHES
    out = tmp_path / "edit.json"
    argv = ["--target", str(smollm_q4), "--tasks", "2", "--n-predict", "12", "--ctx", "1024",
            "--json", str(out), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert edit.main(argv) == 0
    printed = capsys.readouterr().out
    assert "localspec/plain" in printed and "localspec/auto" in printed
    doc = json.loads(out.read_text())
    rows = {r["server"]: r for r in doc["rows"]}
    assert rows["localspec/auto"]["identical"] == rows["localspec/auto"]["compared"] == 2
    assert all(r["tasks"] == 2 and r["tokens"] > 0 and not r["errors"] for r in rows.values())
    answers = doc["answers"]
    assert len(answers) == 4 and all(a["ttft_ms"] is not None for a in answers if a["n"])
    assert doc["verdict"][-1].startswith("PASS localspec/auto answers identical")


def test_llama_server_modes_combine_and_match_localspecs_weight_buffers(tmp_path: Path) -> None:
    from localspec.bench import anchor
    from localspec.engine.llama import default_repack_weights

    serve = anchor.ServeSettings(target=tmp_path / "t.gguf", draft=tmp_path / "d.gguf")
    argv = anchor.llama_server_spec(Path("llama-server"), serve, "ngram-mod&draft", port=1).argv
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod,draft-simple"
    assert argv[argv.index("-md") + 1] == str(serve.draft)
    plain = anchor.llama_server_spec(Path("llama-server"), serve, "plain", port=1).argv
    assert "--spec-type" not in plain and "-md" not in plain
    # the same extra weight buffers as localspec's engine on this CPU
    assert ("--no-repack" in plain) == (not default_repack_weights())
    with pytest.raises(ValueError, match="needs a draft model"):
        no_draft = anchor.ServeSettings(target=serve.target)
        anchor.llama_server_spec(Path("llama-server"), no_draft, "ngram-mod&draft", port=1)

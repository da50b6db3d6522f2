"""The throughput benchmark: clients at once, background load, the report's arithmetic."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from localspec.bench import anchor
from localspec.bench.background import busy_loops, levels
from localspec.bench.throughput import Cell, Request, compare, main, merge, table


def test_background_loops_run_for_the_block_only() -> None:
    with busy_loops(2, settle_s=0.0) as pids:
        assert len(pids) == 2
        assert all(psutil.Process(p).is_running() for p in pids)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert levels("0,1,2") == [0, 1, 2]
    for bad in ("", "x", "-1"):
        with pytest.raises(ValueError):
            levels(bad)


_KILLED_BENCHMARK = """
import os, signal, sys
from localspec.bench.background import busy_loops
with busy_loops(2, settle_s=0.0) as pids:
    print(*pids, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # no finally runs
"""


def test_background_loops_end_with_a_benchmark_that_is_killed() -> None:
    run = subprocess.run(
        [sys.executable, "-c", _KILLED_BENCHMARK], capture_output=True, text=True, timeout=60
    )
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 2, run.stderr
    try:
        _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], 20)
        assert alive == []
    finally:
        for p in pids:
            if psutil.pid_exists(p):
                psutil.Process(p).kill()


_HUNG_UP_BENCHMARK = """
import sys, time
from localspec.bench.command import interruptible

def run(_args):
    try:
        print("running", flush=True)
        time.sleep(60)
    finally:
        print("servers stopped", flush=True)
    return 0

sys.exit(interruptible(run, None))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signal")
def test_a_benchmark_whose_terminal_closes_stops_its_servers() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HUNG_UP_BENCHMARK], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "running\n"
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(30) == 130
    assert proc.stdout.read() == "servers stopped\n"


def test_cells_report_aggregate_speed_and_ratios_to_llama_server() -> None:
    def cell(server: str, wall: float, tps: float) -> Cell:
        reqs = [Request(1.0 + i, True, i, "x", True, 50, 400, 500.0, tps) for i in range(4)]
        return Cell(server, 1, 4, wall, [*reqs, Request(9.0, False, error="503")])

    ours, theirs = cell("localspec", 4.0, 40.0), cell("llama-server/plain", 8.0, 20.0)
    assert ours.aggregate_tps == 200 / 4.0 and ours.errors == 1
    assert ours.latency(50) == 2.5 and ours.decode_tps == 40.0
    text = table([ours, theirs])
    assert "agg 2.00x" in text and "decode 2.00x" in text
    (both,) = merge([ours, cell("localspec", 4.0, 40.0)])
    assert len(both.requests) == 10 and both.wall_s == 8.0


def _token(text: str, p: float, runner_up: str, q: float) -> dict[str, object]:
    """One token of an n_probs report, as llama-server (and localspec) write it."""

    def candidate(t: str, prob: float) -> dict[str, object]:
        return {"id": 0, "token": t, "bytes": list(t.encode()), "logprob": math.log(prob)}

    return {**candidate(text, p), "top_logprobs": [candidate(text, p), candidate(runner_up, q)]}


def test_an_answer_that_parts_from_its_answer_alone_gets_the_margin_there() -> None:
    """The answers alone carry each token's two likeliest candidates: an answer decoded beside
    others that takes another path is placed on the token where it did, with how near a tie
    that was (the top-2 margin) and whether it took the runner-up."""
    alone = Request(1.0, True, content="x = 1\n", report=[
        _token("x", 0.9, "y", 0.05), _token(" =", 0.8, " +", 0.1),
        _token(" 1", 0.46, " 2", 0.44), _token("\n", 0.9, ";", 0.05),
    ])  # fmt: skip
    same = Request(1.0, True, content="x = 1\n")
    compare(same, alone)
    assert same.same_as_alone is True and same.parted_margin is None
    tie = Request(1.0, True, content="x = 2\n")
    compare(tie, alone)
    assert tie.same_as_alone is False and tie.took_runner_up is True
    assert tie.parted_margin == pytest.approx(0.02)
    off = Request(1.0, True, content="x + 1\n")
    compare(off, alone)
    assert off.parted_margin == pytest.approx(0.7) and off.took_runner_up is True
    failed = Request(1.0, False, error="503")
    compare(failed, alone)
    assert failed.same_as_alone is None
    cell = Cell("localspec", 0, 2, 1.0, [same, tie, off, failed])
    assert cell.parted_margins == [pytest.approx(0.02), pytest.approx(0.7)]
    assert cell.summary()["parted_took_runner_up"] == 2
    assert "    0.700" in table([cell])


def test_llama_server_gets_the_slots_and_one_kv_buffer() -> None:
    serve = anchor.ServeSettings(target=Path("t.gguf"), ctx=2048, slots=4, kv_unified=True)
    argv = anchor.llama_server_spec(Path("llama-server"), serve, "plain", port=1).argv
    assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == "8192"
    assert "-kvu" in argv and argv[argv.index("--cache-ram") + 1] == "0"
    ours = anchor.localspec_spec(serve, port=1).argv
    assert ours[ours.index("--slots") + 1] == "4" and ours[ours.index("--ctx-size") + 1] == "2048"


def _run(tmp_path: Path, target: Path, *args: str) -> dict[str, Any]:
    """One localspec-only run of the benchmark (1 thread, logs under ``tmp_path``): its JSON."""
    out = tmp_path / "t.json"
    argv = ["--target", str(target), *args, "--vs-llama-server", "", "--threads", "1",
            "--log-dir", str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_a_real_run_against_localspec(qwen_target: Path, tmp_path: Path) -> None:
    """Two clients at once on two slots, beside a busy process: every request answered, after
    one unmeasured warm-up request and the answers alone."""
    doc = _run(tmp_path, qwen_target, "--clients", "2", "--requests", "1", "--n-predict", "4",
               "--prompt-chars", "300", "--background", "1", "--ctx", "1024")  # fmt: skip
    (c,) = doc["cells"]
    assert (c["server"], c["background"], c["clients"]) == ("localspec", 1, 2)
    assert c["requests"] == 2 and c["errors"] == 0 and c["aggregate_tokens_per_s"] > 0
    assert all(r["predicted_n"] == 4 and r["prompt_n"] > 20 for r in doc["requests"])
    (log,) = (tmp_path / "logs").iterdir()
    assert log.read_text().count("POST /completion 200") == 1 + 2 + 2  # warm-up, alone, cell


def test_a_context_head_is_cached_on_every_slot_and_only_the_snippets_are_evaluated(
    qwen_target: Path, tmp_path: Path
) -> None:
    """``--context-chars``: the same code heads every prompt and is cached on both slots before
    the answers alone and before the cell, so each request evaluates only its own snippet."""
    doc = _run(tmp_path, qwen_target, "--clients", "2", "--requests", "2", "--n-predict", "2",
               "--prompt-chars", "300", "--context-chars", "3000", "--ctx", "2048")  # fmt: skip
    (c,) = doc["cells"]
    assert c["requests"] == 4 and c["errors"] == 0
    for r in doc["requests"]:
        # the head (3 000 characters) reused, the snippet (300) evaluated: far fewer tokens
        assert r["cache_n"] > 2 * r["prompt_n"] > 0, r
    (log,) = (tmp_path / "logs").iterdir()
    # warm-up, each of 2 slots primed, 4 alone, each slot primed again, 4 in the cell
    assert log.read_text().count("POST /completion 200") == 1 + 2 + 4 + 2 + 4


def test_a_chat_model_beside_the_target_answers_before_each_cell(
    qwen_target: Path, smollm_q4: Path, tmp_path: Path
) -> None:
    """``--chat-target``: a second localspec with an instruct model beside the target; its chat
    model answers one chat request before each cell, and both daemons' completions are counted."""
    doc = _run(tmp_path, qwen_target, "--chat-target", str(smollm_q4), "--clients", "1",
               "--requests", "1", "--n-predict", "4", "--prompt-chars", "300", "--ctx", "1024",
               "--repeats", "2")  # fmt: skip
    logs = tmp_path / "logs"
    assert sorted(c["server"] for c in doc["cells"]) == ["localspec", "localspec+chat"]
    assert all(c["requests"] == 2 and c["errors"] == 0 for c in doc["cells"])
    (chat_argv,) = [s["argv"] for s in doc["servers"] if s["name"] == "localspec+chat"]
    assert chat_argv[chat_argv.index("--chat-target") + 1] == str(smollm_q4)
    chat_log = next(p for p in logs.iterdir() if p.name.startswith("localspec+chat"))
    assert chat_log.read_text().count("POST /v1/chat/completions 200") == 2  # one per cell

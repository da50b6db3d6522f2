"""The speculative benchmark measures what a one-slot daemon runs."""

from __future__ import annotations

from pathlib import Path

from localspec.bench.speculative import run


def test_the_benchmark_attends_as_a_one_slot_daemon(qwen_target: Path, qwen_draft: Path) -> None:
    """Its second slot only re-scores diverging answers; with the several-slot rule it would
    measure speculation with flash attention on, whose verify batches cost more on a CPU than
    the one-slot daemon's (this build has no GPU and an f16 KV cache: off)."""
    result = run(
        target=str(qwen_target),
        draft=str(qwen_draft),
        n_prompts=1,
        n_predict=8,
        repeats=1,
        lines=8,
        modes=("target-only", "auto"),
        progress=False,
    )
    assert result["flash_attn"] is False
    assert {row["mode"] for row in result["rows"]} == {"target-only", "auto"}
    assert all(row["tokens"] > 0 for row in result["rows"])

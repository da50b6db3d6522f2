"""Benchmark: KV buffer compaction on an editor's file switch, on and off side by side.

Replays, on one model's slot cache, the prefill sequence localspec's server log shows at a
file switch in ``localspec bench replay`` (4096-token context; sizes scale with ``--ctx``):

1. the cache holds the last location's prompt (95 % of the context, cells in order);
2. the ring warm-up: a 743-token run of it moves to the front, new ring chunks follow, and a
   keystroke supersedes it after 1 771 tokens;
3. the keystrokes: the ring moves again (one chunk evicted, 320 tokens), the new location's
   prefix and suffix follow; they stop 512 tokens in;
4. the end-of-line request's prefill, then 30 decoding steps.

Each repeat runs the whole sequence with compaction on and with it off, in a fresh context,
alternating, and the report gives each phase's time and the ratio on/off.

    python -m localspec.bench.kvcompact --model MODEL.gguf [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from localspec.bench import harness
from localspec.bench.corpus import stdlib_files
from localspec.bench.stats import fmt
from localspec.engine.cache import COMPACT_MIN_WORK, COMPACT_OFF, PrefillPolicy, SlotCaches
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.types import ModelSettings
from localspec.engine.vocab import Vocab

PHASES = ("ring warm-up", "keystrokes", "end-of-line prefill", "30 decoding steps")


def scenario(tokens: list[int], n_ctx: int) -> dict[str, Any]:
    """The prompts of the four phases, sized as the 4096-token replay's, scaled to n_ctx."""

    def at(n: int) -> int:
        return max(1, round(n * n_ctx / 4096))

    need = at(3886) + at(2071) + at(637) + at(4) + 64
    if len(tokens) < need:
        raise ValueError(f"need {need} tokens of source text, got {len(tokens)}")
    cached = tokens[: at(3886)]
    fresh = iter(range(at(3886), len(tokens)))

    def new(n: int) -> list[int]:
        return [tokens[next(fresh)] for _ in range(n)]

    run = cached[at(2071) : at(2071) + at(743)]
    ring = new(at(2)) + run + new(at(2071))
    key = ring[at(320) :] + new(at(637))
    return {
        "cached": cached,
        "warm_up": ring[: at(1771)],
        "keystrokes": key[: at(1449) + at(512)],
        "final": key,
        "decode": new(30),
        "min_chunk": max(16, at(256)),
    }


def run_once(model: Model, settings: ModelSettings, sc: dict[str, Any], compact: bool) -> dict:
    ctx = Context(model, settings, n_seq=2, n_ctx_total=settings.n_ctx, clock=Clock())
    try:
        caches = SlotCaches(ctx, 1, compact_min_work=COMPACT_MIN_WORK if compact else COMPACT_OFF)
        slot = caches.slots[0]
        caches.prefill(slot, sc["cached"], PrefillPolicy(chunk=512))
        times: list[float] = []
        for name in ("warm_up", "keystrokes", "final"):
            t0 = time.perf_counter()
            caches.prefill(slot, sc[name], PrefillPolicy(min_chunk=sc["min_chunk"], chunk=128))
            times.append((time.perf_counter() - t0) * 1000.0)
        t0 = time.perf_counter()
        for tok in sc["decode"]:
            caches.append(slot, [tok], logits="last")
        times.append((time.perf_counter() - t0) * 1000.0)
        return {"ms": times, "compactions": caches.n_compacted}
    finally:
        ctx.close()


def measure(model_path: Path, *, n_ctx: int, threads: int | None, repeats: int) -> dict:
    settings = ModelSettings(
        str(model_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
        flash_attn=False,
    )  # fmt: skip
    model = Model(settings)
    try:
        vocab = Vocab(model.vocab_handle)
        text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files())
        text = text[: 64 * n_ctx]  # ~16 tokens of code per context cell; the scenario needs ~1.7
        sc = scenario(vocab.tokenize(text), n_ctx)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for i in range(repeats):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                runs[mode].append(run_once(model, settings, sc, mode == "on"))
                print(f"  repeat {i + 1}/{repeats}: compaction {mode} done", file=sys.stderr)
    finally:
        model.close()
    phases = []
    for k, name in enumerate((*PHASES, "total")):
        row: dict[str, Any] = {"phase": name}
        for mode in ("off", "on"):
            vals = [sum(r["ms"]) if name == "total" else r["ms"][k] for r in runs[mode]]
            row[f"{mode}_ms"] = statistics.median(vals)
        row["ratio"] = row["on_ms"] / row["off_ms"] if row["off_ms"] > 0 else None
        phases.append(row)
    return {
        "benchmark": "kvcompact",
        "model": str(model_path),
        "n_ctx": n_ctx,
        "threads": threads,
        "repeats": repeats,
        "compactions_per_run": {m: runs[m][0]["compactions"] for m in runs},
        "phases": phases,
        "runs": runs,
    }


def table(report: dict) -> str:
    lines = [
        f"KV compaction, {Path(report['model']).name}, n_ctx {report['n_ctx']}, "
        f"median of {report['repeats']} (compactions per run: "
        f"{report['compactions_per_run']['on']} on, {report['compactions_per_run']['off']} off)",
        f"{'phase':<22}{'off ms':>10}{'on ms':>10}{'on/off':>9}",
    ]
    for row in report["phases"]:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        lines.append(f"{row['phase']:<22}{fmt(row['off_ms']):>10}{fmt(row['on_ms']):>10}{ratio:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m localspec.bench.kvcompact", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="a GGUF model file")
    p.add_argument("--ctx", type=int, default=4096, help="context size (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode (default 3)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    args = p.parse_args(argv)
    if not args.model.is_file():
        p.error(f"model file not found: {args.model}")
    if args.repeats < 1 or args.ctx < 256:
        p.error("--repeats must be >= 1 and --ctx >= 256")
    report = measure(args.model, n_ctx=args.ctx, threads=args.threads, repeats=args.repeats)
    table_text = table(report)
    print(table_text)
    harness.record("kvcompact", argv, table_text, report, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

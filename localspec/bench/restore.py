"""Benchmark: a slot context's copy to and from host memory vs evaluating it, per token.

What the host cache (engine/hostcache.py) decides by: for contexts of each size, the prompt
evaluated cold in a fresh slot, then the slot's state (target and draft KV) copied out
(``slotstate.take``) and back in (``slotstate.put``). Prints a table and writes JSON.

    python -m localspec.bench.restore --target T.gguf [--draft D.gguf] [--tokens 512,2048]
        [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from localspec.bench import harness
from localspec.bench.corpus import stdlib_files
from localspec.engine import slotstate
from localspec.engine.engine import Engine
from localspec.engine.threads import physical_cores
from localspec.engine.types import EngineSettings, GenerationRequest, ModelSettings


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="localspec bench restore", description=__doc__)
    p.add_argument("--target", required=True, help="target GGUF")
    p.add_argument("--draft", help="draft GGUF (its KV is copied too)")
    p.add_argument("--tokens", default="512,1024,2048", help="context sizes to measure")
    p.add_argument("--ctx", type=int, default=4096, help="context per slot")
    p.add_argument("--threads", type=int, default=None, help="threads (default: cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def measure(engine: Engine, prompt: list[int], repeats: int) -> dict[str, Any]:
    prefill, take, put, n_bytes = [], [], [], 0
    for _ in range(repeats):
        engine.clear_slot(0)
        res = engine.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=0))
        prefill.append(res.prompt_ms)
        t0 = time.perf_counter()
        snap = slotstate.take(engine.pair, 0)
        take.append((time.perf_counter() - t0) * 1e3)
        n_bytes = snap.n_bytes
        engine.clear_slot(0)
        t0 = time.perf_counter()
        slotstate.put(engine.pair, 0, snap)
        put.append((time.perf_counter() - t0) * 1e3)
        if engine.slot_tokens(0) != prompt:
            raise RuntimeError("the restored slot does not hold the prompt")
    n = len(prompt)
    row = {
        "tokens": n,
        "state_bytes": n_bytes,
        "prefill_ms": statistics.median(prefill),
        "take_ms": statistics.median(take),
        "put_ms": statistics.median(put),
    }
    row["prefill_ms_per_token"] = row["prefill_ms"] / n
    row["copy_ms_per_token"] = (row["take_ms"] + row["put_ms"]) / n
    row["put_ms_per_mib"] = row["put_ms"] / (n_bytes / (1 << 20))
    row["prefill_over_restore"] = row["prefill_ms"] / max(row["put_ms"], 1e-6)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    threads = args.threads or physical_cores()
    sizes = [int(s) for s in args.tokens.split(",")]
    model = ModelSettings(
        path=args.target, n_ctx=args.ctx, n_batch=512, n_ubatch=512, n_threads=threads,
        n_threads_batch=threads,
    )  # fmt: skip
    draft = replace(model, path=args.draft) if args.draft else None
    settings = EngineSettings(target=model, draft=draft, n_slots=1, host_cache_bytes=0)
    engine = Engine(settings)
    try:
        text = "".join(path.read_text() for path in stdlib_files()[:40])
        tokens = engine.vocab.tokenize(text)
        rows = []
        for n in sizes:
            if n >= min(len(tokens), args.ctx):
                raise SystemExit(f"--tokens {n}: more than the text or the context holds")
            rows.append(measure(engine, tokens[:n], args.repeats))
    finally:
        engine.close()
    head = f"{'tokens':>7} {'state MiB':>10} {'prefill ms':>11} {'take ms':>8} {'put ms':>7}"
    lines = [head + f" {'prefill/put':>12}"]
    for r in rows:
        lines.append(
            f"{r['tokens']:>7} {r['state_bytes'] / (1 << 20):>10.1f} {r['prefill_ms']:>11.1f} "
            f"{r['take_ms']:>8.2f} {r['put_ms']:>7.2f} {r['prefill_over_restore']:>11.0f}x"
        )
    table = "\n".join(lines)
    print(table)
    out = {
        "target": args.target,
        "draft": args.draft,
        "threads": threads,
        "repeats": args.repeats,
        "rows": rows,
    }
    harness.record("restore", argv, table, out, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

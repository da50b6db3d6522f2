"""``localspec bench steps``: a decode step's time by the sequences in it, measured here.

How many slots a team server holds at the latency bound rests on how long one step takes with
N slots busy. This measures it for one model file on this machine: N sequences, each with
``--kv-tokens`` of context of its own in one KV buffer (as the engine keeps its slots), one
token each per step. It prints the table, writes JSON, and keeps the figures where
``localspec plan`` finds them: the plan then says its step times are measured, not assumed.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from localspec.bench import harness
from localspec.bench.background import levels
from localspec.bench.command import bench_parser
from localspec.bench.corpus import code_prompts
from localspec.engine.llama import Clock, Context, Model, Segment
from localspec.engine.types import ModelSettings
from localspec.engine.vocab import Vocab

EPILOG = """\
examples:
  localspec bench steps --target ~/models/qwen2.5-coder-7b-q8_0.gguf --batches 1,8,32
  localspec bench steps --target t.gguf --model qwen2.5-coder-7b --quant Q8_0 --no-save
"""


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("localspec bench steps", __doc__, EPILOG)
    p.add_argument("--target", type=Path, required=True, metavar="GGUF", help="model file")
    p.add_argument("--model", help="catalog model id (default: found by the file's name)")
    p.add_argument("--quant", help="its quantization (default: found by the file's name)")
    p.add_argument("--batches", default="1,2,4,8,16", help="sequences per step to measure")
    p.add_argument("--kv-tokens", type=int, default=1024, help="context per sequence")
    p.add_argument("--steps", type=int, default=8, help="steps per size (the median counts)")
    p.add_argument("--threads", type=int, help="CPU threads (default: physical cores)")
    p.add_argument("--gpu-layers", type=int, default=-1, help="layers offloaded (default all)")
    p.add_argument("--no-save", action="store_true", help="do not keep the figures for `plan`")
    p.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON")
    return p


def catalog_key(path: Path) -> tuple[str, str] | None:
    """(model id, quant) of the catalog entry whose main file is ``path``'s name."""
    from localspec.commands.models import load_catalog

    for model in load_catalog().models.values():
        for quant, entry in model.quants.items():
            if entry.main_file.filename == path.name:
                return model.id, quant
    return None


def measure(
    ctx: Context, tokens: Sequence[int], batches: Sequence[int], steps: int, progress: bool
) -> dict[int, float]:
    """Median ms of a step of b tokens (one per sequence) for each b in ``batches``."""
    n_seq, kv = max(batches), len(tokens)
    per_call = max(1, ctx.n_batch // kv) if kv <= ctx.n_batch else 1
    for first in range(0, n_seq, per_call):  # each sequence gets its own cells
        seqs = range(first, min(n_seq, first + per_call))
        for start in range(0, kv, ctx.n_batch):
            part = tokens[start : start + ctx.n_batch]
            ctx.decode_many([Segment(part, start, s, "none") for s in seqs])
        if progress:
            print(f"  context of {seqs[-1] + 1}/{n_seq} sequences", file=sys.stderr, flush=True)
    out: dict[int, float] = {}
    for b in sorted(set(batches)):
        times = []
        for step in range(steps + 1):  # the first step warms up
            t0 = time.perf_counter()
            ctx.decode_many([Segment([tokens[step % kv]], kv + step, s, "last") for s in range(b)])
            times.append((time.perf_counter() - t0) * 1000.0)
        for s in range(b):
            ctx.seq_rm(s, kv, -1)
        out[b] = statistics.median(times[1:])
        if progress:
            print(f"  {b} sequences: {out[b]:.2f} ms a step", file=sys.stderr, flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from localspec import hardware, step_costs
    from localspec.planning.types import StepCosts

    args = build_parser().parse_args(argv)
    try:
        batches = [b for b in levels(args.batches) if b > 0]
        if not batches or args.kv_tokens < 1 or args.steps < 1:
            raise ValueError("--batches, --kv-tokens and --steps must be positive")
        if not args.target.is_file():
            raise ValueError(f"model file not found: {args.target}")
        key = (args.model, args.quant) if args.model and args.quant else catalog_key(args.target)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = ModelSettings(
        str(args.target),
        n_gpu_layers=args.gpu_layers,
        n_ctx=args.kv_tokens + args.steps + 8,
        n_threads=args.threads,
        n_threads_batch=args.threads,
    )
    n_seq = max(batches)
    print(f"loading {args.target.name}", file=sys.stderr, flush=True)
    model = Model(settings)
    ctx = Context(model, settings, n_seq=n_seq, n_ctx_total=settings.n_ctx * n_seq, clock=Clock())
    try:
        vocab = Vocab(model.vocab_handle)
        text = "".join(code_prompts(max(4, args.kv_tokens // 200), lines=40))
        tokens = vocab.tokenize(text)[: args.kv_tokens]
        if len(tokens) < args.kv_tokens:
            tokens = (tokens * (args.kv_tokens // max(1, len(tokens)) + 1))[: args.kv_tokens]
        ms = measure(ctx, tokens, batches, args.steps, progress=True)
    finally:
        ctx.close()
        model.close()
    machine = hardware.probe().description
    when = datetime.date.today().isoformat()
    source = f"`localspec bench steps` on {machine}, {when}, {ctx.n_threads} threads"
    rows = [f"{'sequences':>9} {'ms a step':>10} {'tokens/s':>9}"]
    rows += [f"{b:>9} {t:>10.2f} {b / t * 1000:>9.1f}" for b, t in ms.items()]
    table_text = "\n".join(rows)
    print("\n" + table_text)
    if key is None:
        print(
            f"\n{args.target.name} is not a catalog file: give --model and --quant to keep these "
            "figures for `localspec plan`",
            file=sys.stderr,
        )
    elif not args.no_save:
        costs = StepCosts(ms, args.kv_tokens, source)
        path = step_costs.save(*key, costs, machine=machine)
        print(f"\nkept for `localspec plan` ({key[0]} {key[1]}): {path}", file=sys.stderr)
    doc = {"benchmark": "steps", "model": key, "file": str(args.target), "source": source,
           "kv_tokens": args.kv_tokens, "ms_by_sequences": ms}  # fmt: skip
    harness.record("steps", argv, table_text, doc, json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

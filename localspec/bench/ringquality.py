"""Benchmark: what ring blocks cost in quality, as the likelihood of the code that follows.

``--ring-attention blocks`` evaluates each extra-context chunk on its own (each sees only
itself; the cursor's code sees them all), which makes a rotated ring exact to reuse. The
model was trained with every chunk seeing the ones before it, so blocks may use the context
less well. This measures it on real code, model-agnostically: for N cursor locations in the
Python standard library, the mean negative log-likelihood (nats per token) of the next lines
of the file, given the file's preceding lines and

* no ring at all (how much the ring helps: the scale),
* a ring of chunks from the same file and others, causal (llama-server's attention),
* the same ring, causal, as a session leaves it: the slot held the ring one rotation earlier
  (an older chunk in front, the newest not yet in) and another location's code, and the new
  prompt reuses the moved chunks by a KV shift (``--cache-reuse 256``), as llama-server does,
* the same ring as blocks, cold and after the same rotation (equal up to rounding),
* blocks that also see the repository header (the first block) as an attention sink, the
  server's default (``prefill(sink=True)``).

Same prompts, same model, one process; the report gives each mode's mean, the paired
differences with their standard error, and the share of the ring's gain that blocks keep.

    python -m localspec.bench.ringquality --model MODEL.gguf [--samples 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localspec.bench import harness
from localspec.bench.corpus import stdlib_files
from localspec.bench.stats import fmt
from localspec.engine.cache import PrefillPolicy, SlotCaches
from localspec.engine.llama import Clock, Context, Model
from localspec.engine.types import ModelSettings
from localspec.engine.vocab import Vocab
from localspec.server.prompts import Extra, extra_blocks

MODES = (
    "no ring", "causal ring", "causal, rotated", "block ring", "block, rotated", "sink blocks",
)  # fmt: skip
CACHE_REUSE = 256  # llama-vscode's llama-server preset, localspec's default


@dataclass(frozen=True)
class Sample:
    name: str  # file:line
    ring: list[Extra]
    older: Extra  # the chunk the ring held before its newest one came in
    before: str  # the code of the location before this one (another file)
    prefix: str
    continuation: str


def samples(
    files: Sequence[Path],
    n: int,
    *,
    seed: int,
    prefix_lines: int,
    next_lines: int,
    same_file: int,
    other_files: int,
    chunk_lines: int,
) -> list[Sample]:
    """Seeded cursor locations: the lines before the cursor, the ring, the lines after."""
    rng = random.Random(seed)
    texts = {p: p.read_text(errors="replace").splitlines() for p in files}
    big = [p for p, lines in texts.items() if len(lines) >= 6 * chunk_lines + prefix_lines]
    if len(big) < 2:
        raise ValueError("need at least two source files long enough for a ring")
    out: list[Sample] = []
    while len(out) < n:
        path = rng.choice(big)
        lines = texts[path]
        # the cursor leaves room above it for same-file chunks outside the prefix window
        lo = same_file * chunk_lines + prefix_lines
        hi = len(lines) - next_lines
        if hi <= lo:
            continue
        cursor = rng.randrange(lo, hi)
        continuation = "\n".join(lines[cursor : cursor + next_lines]) + "\n"
        if len(continuation.strip()) < 40:
            continue
        ring: list[Extra] = []
        above = cursor - prefix_lines  # same-file chunks come from above the prefix window
        for start in sorted(rng.sample(range(0, above - chunk_lines + 1), same_file)):
            ring.append(_chunk(path, lines, start, chunk_lines))
        for other in rng.sample([p for p in big if p != path], other_files):
            start = rng.randrange(0, len(texts[other]) - chunk_lines)
            ring.insert(
                rng.randrange(len(ring) + 1), _chunk(other, texts[other], start, chunk_lines)
            )
        prefix = "\n".join(lines[cursor - prefix_lines : cursor]) + "\n"
        other = rng.choice([p for p in big if p != path])
        older = _chunk(
            other, texts[other], rng.randrange(0, len(texts[other]) - chunk_lines), chunk_lines
        )
        at = rng.randrange(0, len(texts[other]) - prefix_lines)
        before = "\n".join(texts[other][at : at + prefix_lines]) + "\n"
        out.append(Sample(f"{path.name}:{cursor + 1}", ring, older, before, prefix, continuation))
    return out


def _chunk(path: Path, lines: list[str], start: int, n: int) -> Extra:
    return Extra("\n".join(lines[start : start + n]) + "\n", path.name)


def _log_softmax_at(logits: np.ndarray, token: int) -> float:
    top = float(np.max(logits))
    return float(logits[token] - top - math.log(float(np.sum(np.exp(logits - top)))))


def nll(
    caches: SlotCaches,
    prompt: list[int],
    blocks: Sequence[int],
    cont: list[int],
    before: tuple[list[int], Sequence[int]] | None = None,
    sink: bool = False,
) -> float:
    """Mean negative log-likelihood of ``cont`` after ``prompt``: from a cold slot, or from
    one that held ``before`` (a prompt and its blocks), reusing it as the server does."""
    slot = caches.slots[0]
    caches.clear(slot)
    if before is not None:
        caches.prefill(slot, before[0], PrefillPolicy(), blocks=before[1], sink=sink)
    reuse = PrefillPolicy(min_chunk=CACHE_REUSE if before else 0)
    caches.prefill(slot, prompt, reuse, blocks=blocks, sink=sink)
    total = -_log_softmax_at(np.asarray(caches.ctx.logits(-1)), cont[0])
    caches.append(slot, cont[:-1], logits="all")
    for i, token in enumerate(cont[1:]):
        total -= _log_softmax_at(np.asarray(caches.ctx.logits(i)), token)
    return total / len(cont)


def run(
    model_path: Path, picked: Sequence[Sample], *, threads: int, max_cont: int
) -> list[dict[str, Any]]:
    settings = ModelSettings(
        str(model_path), n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads
    )
    model = Model(settings)
    ctx = Context(model, settings, n_seq=3, n_ctx_total=settings.n_ctx, clock=Clock())
    try:
        vocab = Vocab(model.vocab_handle)
        ids = vocab.fim  # only the repository/file separators are used (when it has them)
        caches = SlotCaches(ctx, 1)
        rows: list[dict[str, Any]] = []
        # every prompt starts with a repository header, the first block (the one the sink
        # blocks see): the vocabulary's own (FIM_REP myproject) or, without one, a text line
        bos = [] if ids.rep is not None else vocab.tokenize("# repository: myproject\n")
        for i, sample in enumerate(picked):
            extra, lengths = extra_blocks(vocab.tokenize, ids, sample.ring)
            prefix = vocab.tokenize(sample.prefix)
            cont = vocab.tokenize(sample.continuation)[:max_cont]
            t0 = time.perf_counter()
            row: dict[str, Any] = {"sample": sample.name, "n_ring": len(extra), "n_cont": len(cont)}
            old, old_lengths = extra_blocks(vocab.tokenize, ids, [sample.older, *sample.ring[:-1]])
            old_prompt = bos + old + vocab.tokenize(sample.before)
            ring = bos + extra + prefix
            blocks = [len(bos), *lengths] if bos else lengths
            old_blocks = [len(bos), *old_lengths] if bos else old_lengths
            row["no ring"] = nll(caches, bos + prefix, (), cont)
            row["causal ring"] = nll(caches, ring, (), cont)
            row["causal, rotated"] = nll(caches, ring, (), cont, (old_prompt, ()))
            row["block ring"] = nll(caches, ring, blocks, cont)
            row["block, rotated"] = nll(caches, ring, blocks, cont, (old_prompt, old_blocks))
            row["sink blocks"] = nll(caches, ring, blocks, cont, sink=True)
            rows.append(row)
            print(
                f"[{i + 1}/{len(picked)}] {sample.name:28} "
                + "  ".join(f"{m} {row[m]:.3f}" for m in MODES)
                + f"  ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return rows
    finally:
        ctx.close()
        model.close()


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def mean_se(values: list[float]) -> tuple[float, float]:
        m = statistics.fmean(values)
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
        return m, se

    out: dict[str, Any] = {"samples": len(rows)}
    for mode in MODES:
        out[mode] = mean_se([r[mode] for r in rows])
    gain = [r["no ring"] - r["causal ring"] for r in rows]
    out["ring gain (no ring - causal)"] = mean_se(gain)
    total_gain = sum(gain)
    for mode in MODES[2:]:
        cost = [r[mode] - r["causal ring"] for r in rows]
        out[f"{mode} - causal ring"] = mean_se(cost)
        out[f"share of the ring's gain kept: {mode}"] = (
            (total_gain - sum(cost)) / total_gain if total_gain > 0 else float("nan")
        )
    for mode in ("block, rotated", "sink blocks"):
        out[f"samples where {mode} beat causal, rotated"] = sum(
            1 for r in rows if r[mode] < r["causal, rotated"]
        )
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'nats per token of the next lines':44} {'mean':>8} {'+- se':>8}"]
    for key, value in summary.items():
        if isinstance(value, tuple):
            lines.append(f"{key:44} {fmt(value[0], '.4f'):>8} {fmt(value[1], '.4f'):>8}")
        elif isinstance(value, float):
            lines.append(f"{key:44} {fmt(value, '.2f'):>8}")
        else:
            lines.append(f"{key:44} {value:>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m localspec.bench.ringquality",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--model", type=Path, required=True, help="GGUF model file")
    p.add_argument("--samples", type=int, default=24, help="cursor locations (default 24)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix-lines", type=int, default=30, help="lines before the cursor")
    p.add_argument("--next-lines", type=int, default=8, help="lines scored after the cursor")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens scored per sample")
    p.add_argument("--same-file", type=int, default=3, help="ring chunks from the same file")
    p.add_argument("--other-files", type=int, default=1, help="ring chunks from other files")
    p.add_argument("--chunk-lines", type=int, default=32, help="lines per ring chunk")
    p.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = p.parse_args(argv)
    if not args.model.is_file():
        print(f"error: model file not found: {args.model}", file=sys.stderr)
        return 2
    try:
        picked = samples(
            stdlib_files(),
            args.samples,
            seed=args.seed,
            prefix_lines=args.prefix_lines,
            next_lines=args.next_lines,
            same_file=args.same_file,
            other_files=args.other_files,
            chunk_lines=args.chunk_lines,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = run(args.model, picked, threads=args.threads, max_cont=args.max_tokens)
    summary = summarize(rows)
    table_text = table(summary)
    print(table_text)
    print(f"\n{len(rows)} samples in {time.perf_counter() - t0:.0f} s")
    doc = {
        "benchmark": "ringquality",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
        "rows": rows,
    }
    harness.record("ringquality", argv, table_text, doc, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: two editors on one slot, and a restart, with the host cache and without.

Two editors (each its own file, cursor line and ring of chunks from its own files) take turns
on slot 0 (``--slots 1``, both send ``id_slot: 0``), ``--keys`` keystrokes each per turn,
greedy. Every keystroke's /infill latency is kept; the first after a switch is a "switch"
key, the others "warm". Then the daemon is stopped cleanly and started again, and the editor
that typed last types ``--keys`` more: the "restart" keys. The same traffic runs against
localspec as it is (host cache, contexts kept across the restart) and with both off
(``cache.ram_gb = 0``, ``cache.restart_gb = 0``: the code before issue 51). Prints a table
of p50/p95 by kind and writes JSON.

    python -m localspec bench switch --target T.gguf [--draft D.gguf] [--rounds 3]
        [--keys 6] [--ctx 4096] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from localspec.bench import harness
from localspec.bench.anchor import ManagedServer, ServeSettings, localspec_spec
from localspec.bench.corpus import stdlib_files
from localspec.engine.threads import physical_cores

VARIANTS = {
    "localspec": ["--set", "cache.ram_gb=2", "--set", "cache.restart_gb=2"],
    "localspec/before": ["--set", "cache.ram_gb=0", "--set", "cache.restart_gb=0"],
}


@dataclass
class Editor:
    """One editor: a file, a cursor line it types, and its ring of chunks."""

    name: str
    lines: list[str]
    ring: list[dict[str, Any]]
    line: int
    typed: int = 0

    def request(self) -> dict[str, Any]:
        text = self.lines[self.line]
        self.typed = min(self.typed + 1, len(text))
        return {
            "id_slot": 0,
            "input_prefix": "".join(self.lines[max(0, self.line - 120) : self.line]),
            "input_suffix": "".join(self.lines[self.line + 1 : self.line + 60]),
            "input_extra": self.ring,
            "prompt": text[: self.typed],
            "n_predict": 16,
            "top_k": 1,
            "samplers": ["top_k"],
            "cache_prompt": True,
        }


def editors() -> list[Editor]:
    files = [f for f in stdlib_files() if len(f.read_text().splitlines()) > 400]
    if len(files) < 6:
        raise SystemExit("need six source files of 400+ lines in the stdlib corpus")
    out = []
    for i, (own, others) in enumerate(((files[0], files[2:4]), (files[1], files[4:6]))):
        lines = own.read_text().splitlines(keepends=True)
        ring = []
        for other in others:
            src = other.read_text().splitlines(keepends=True)
            for k in range(4):
                ring.append({"text": "".join(src[k * 16 : k * 16 + 16]), "filename": other.name})
        line = next(j for j in range(200, len(lines)) if len(lines[j].strip()) > 20)
        out.append(Editor("AB"[i], lines, ring, line))
    return out


@dataclass
class Run:
    latencies: dict[str, list[float]] = field(default_factory=lambda: {})
    evaluated: dict[str, list[int]] = field(default_factory=lambda: {})  # prompt tokens

    def add(self, kind: str, ms: float, n_evaluated: int) -> None:
        self.latencies.setdefault(kind, []).append(ms)
        self.evaluated.setdefault(kind, []).append(n_evaluated)


def key(client: httpx.Client, editor: Editor, run: Run, kind: str) -> None:
    t0 = time.perf_counter()
    r = client.post("/infill", json=editor.request())
    r.raise_for_status()
    run.add(kind, (time.perf_counter() - t0) * 1e3, r.json()["timings"]["prompt_n"])


def replay(spec: Any, args: argparse.Namespace, log_dir: Path) -> Run:
    run = Run()
    eds = editors()
    server = ManagedServer(spec, log_dir)
    try:
        server.start()
        server.wait_ready()
        with httpx.Client(base_url=spec.url, timeout=600) as client:
            for ed in eds:  # each editor's context filled once, not measured
                key(client, ed, Run(), "fill")
            for _ in range(args.rounds):
                for ed in eds:
                    for k in range(args.keys):
                        key(client, ed, run, "switch" if k == 0 else "warm")
        server.stop()  # SIGTERM: a clean shutdown, as `localspec down`
        server = ManagedServer(spec, log_dir / "restart")  # a log of its own
        server.start()
        server.wait_ready()
        with httpx.Client(base_url=spec.url, timeout=600) as client:
            for _ in range(args.keys):
                key(client, eds[-1], run, "restart")
    finally:
        server.stop()
    return run


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="localspec bench switch", description=__doc__)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path)
    p.add_argument("--rounds", type=int, default=3, help="turns of each editor")
    p.add_argument("--keys", type=int, default=6, help="keystrokes per turn")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    threads = args.threads or physical_cores()
    serve = ServeSettings(target=args.target, draft=args.draft, ctx=args.ctx, threads=threads)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="localspec-switch-") as tmp:
        for name, extra in VARIANTS.items():
            spec = localspec_spec(serve)
            spec.name = name
            spec.argv += extra
            spec.env["LOCALSPEC_CACHE_DIR"] = str(Path(tmp) / name)  # never the user's cache
            run = replay(spec, args, Path(tmp) / "logs")
            results[name] = {
                kind: {
                    "n": len(v),
                    "p50_ms": statistics.median(v),
                    "p95_ms": pct(v, 0.95),
                    "evaluated_tokens": sum(run.evaluated[kind]),
                }
                for kind, v in run.latencies.items()
            }
            results[name]["all"] = {
                "p95_ms": pct(
                    [x for k, v in run.latencies.items() if k != "restart" for x in v], 0.95
                )
            }
    lines = [f"{'server':<18} {'kind':<8} {'n':>3} {'p50 ms':>9} {'p95 ms':>9} {'evaluated':>10}"]
    for name, kinds in results.items():
        for kind in ("warm", "switch", "restart"):
            r = kinds[kind]
            lines.append(
                f"{name:<18} {kind:<8} {r['n']:>3} {r['p50_ms']:>9.0f} {r['p95_ms']:>9.0f} "
                f"{r['evaluated_tokens']:>10}"
            )
        lines.append(f"{name:<18} {'p95 all':<8} {'':>3} {'':>9} {kinds['all']['p95_ms']:>9.0f}")
    table = "\n".join(lines)
    print(table)
    meta = {"target": str(args.target), "draft": str(args.draft), "threads": threads,
            "rounds": args.rounds, "keys": args.keys, "ctx": args.ctx}  # fmt: skip
    harness.record("switch", argv, table, {**meta, "results": results}, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

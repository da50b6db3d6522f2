"""``localspec bench NAME ...``: hand the rest of the command line to the benchmark."""

from __future__ import annotations

import argparse
import importlib

from localspec.commands import common as c

BENCH = c.Command(
    "bench",
    "run a benchmark (speculative, languages, replay, edit, throughput, offload, ...)",
    epilog="""\
examples:
  localspec bench speculative --help     speculative vs plain decoding, draft vs n-gram
  localspec bench languages --help       speculation by language: today vs by-context vs relaxed
  localspec bench replay --help          replay an editor session against the daemon
  localspec bench edit --help            instruction edits (chat) vs llama-server
  localspec bench throughput --help      clients at once, busy machines, vs llama-server
  localspec bench steps --help           step time by busy slots, kept for `localspec plan`
  localspec bench load --help            editor-like clients hammering a running daemon
  localspec bench overhead --help        the server's own time per request, in-process
  localspec bench kvcompact --help       KV compaction after a file switch, off vs on
  localspec bench ringquality --help     what ring blocks cost the model's predictions
  localspec bench offload --help         plan, up and status with the pair on the device
  localspec bench restore --help         a slot context's copy to/from RAM vs its evaluation
  localspec bench switch --help          two editors on one slot, and a restart
  localspec bench render                 docs/benchmarks.md's tables from the result files
Benchmarks print a table and write a result file (bench/results/NAME/, or
$BENCH_RESULTS_DIR); --json FILE also writes the figures alone. Every argument after the
name is theirs.
""",
)
BENCHES = (
    "speculative",
    "languages",
    "replay",
    "edit",
    "throughput",
    "steps",
    "load",
    "overhead",
    "kvcompact",
    "ringquality",
    "offload",
    "restore",
    "switch",
    "render",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = c.add_command(sub, BENCH, run)
    p.add_argument("bench", choices=BENCHES, help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark")


def run(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(f"localspec.bench.{args.bench}")
    except ImportError as exc:
        c.error(f"the {args.bench} benchmark is not in this build ({exc})")
        return c.EXIT_FAILURE
    return int(module.main(list(args.bench_args)) or 0)

"""``localspec bench edit``: instruction edits of real functions, localspec vs llama-server.

Each task (bench/edittasks.py: rename, add type hints, add a docstring, convert a loop, on
functions of the Python standard library) goes as llama.vim's streamed instruction request to
``/v1/chat/completions``, greedy, to every server in turn (the order rotates task by task; the
machine is noisy, so servers are compared within one run). Servers: localspec decoding plainly
(``--spec-mode off``, the reference every speculative answer must equal token for token),
localspec as it runs by default, and llama.cpp's ``llama-server`` with the same files in each
speculative mode asked for (``--spec-type ngram-*``, ``-md`` draft), plus plain.

Reported per server: the decoding speed the client sees (tokens after the first / the time
from the first token to the last, summed over tasks; the ratios and the verdict use it), the
server's own figure (tokens / ``timings.predicted_ms``; localspec counts a draft model's
lazily evaluated prompt as prompt time, so its own figure flatters a draft-model mode), time
to first token (client), draft acceptance, and answers identical to the same server
family's plain answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from localspec.bench import anchor, harness
from localspec.bench.command import bench_parser, interruptible
from localspec.bench.edittasks import EditTask, edit_tasks
from localspec.bench.speculative import stdlib_files
from localspec.bench.stats import fmt, mean, percentile, ratio

EPILOG = """\
examples:
  # localspec (plain and default) vs llama-server's n-gram and draft modes, same files
  localspec bench edit --target smollm-f32.gguf --draft smollm-q4_1.gguf \\
      --vs-llama-server plain,ngram-simple,ngram-mod,ngram-map-k,draft --tasks 8 --json edit.json

llama-server comes from $LLAMA_SERVER_BIN (build it with scripts/build-llama-server.sh).
Targets the issue sets: the best localspec row at >= 1.5x the best llama-server row and >= 2x
localspec's plain decoding, every answer identical to plain decoding, and time to first token
no worse than llama-server's.
"""
PLAIN = "localspec/plain"
LLAMA_PLAIN = "llama-server/plain"
# localspec server variants, after its mode: without the draft model; flash attention on
VARIANTS = ("nodraft", "fa-on")


def reference(server: str) -> str:
    """The plain-decoding row a server's answers must equal: the same server family, and for
    localspec the same attention kernel (flash attention changes the arithmetic)."""
    if not server.startswith("localspec"):
        return LLAMA_PLAIN
    return "localspec/off:fa-on" if server.endswith(":fa-on") else PLAIN


@dataclass
class Answer:
    server: str
    task: int
    text: str = ""
    n: int = 0  # tokens generated (usage.completion_tokens)
    ttft_ms: float | None = None  # request sent -> first content (client)
    end_ms: float = 0.0  # request sent -> [DONE] (client)
    decode_ms: float = 0.0  # the server's timings.predicted_ms
    prompt_ms: float = 0.0
    prompt_n: int = 0
    drafted: int = 0
    accepted: int = 0
    error: str = ""


def ask(url: str, task: EditTask, n_predict: int, extra: dict[str, Any]) -> Answer:
    """One streamed instruction request; the answer and its timings."""
    body = {
        "messages": task.messages(),
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "top_k": 1,
        "max_tokens": n_predict,
        "cache_prompt": True,
        "model": "",
        **extra,
    }
    answer = Answer("", -1)
    parts: list[str] = []
    t0 = time.perf_counter()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as response:
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {response.read().decode()[:300]}"
                return answer
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if answer.ttft_ms is None:
                            answer.ttft_ms = (time.perf_counter() - t0) * 1e3
                        parts.append(content)
                if "usage" in chunk:
                    answer.n = int(chunk["usage"]["completion_tokens"])
                timings = chunk.get("timings")
                if timings:
                    answer.decode_ms = float(timings.get("predicted_ms", 0.0))
                    answer.prompt_ms = float(timings.get("prompt_ms", 0.0))
                    answer.prompt_n = int(timings.get("prompt_n", 0))
                    answer.drafted = int(timings.get("draft_n", 0))
                    answer.accepted = int(timings.get("draft_n_accepted", 0))
    except httpx.HTTPError as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    answer.end_ms = (time.perf_counter() - t0) * 1e3
    answer.text = "".join(parts)
    return answer


@dataclass
class Row:
    server: str
    tasks: int = 0
    tokens: int = 0
    tok_s: float | None = None  # server timings: tokens / decode time
    client_tok_s: float | None = None  # tokens after the first / first-to-last token time
    ttft_p50_ms: float | None = None
    ttft_mean_ms: float | None = None
    acceptance: float | None = None
    drafted: int = 0
    identical: int = 0  # answers equal to the plain answer of the same server family
    compared: int = 0
    errors: list[str] = field(default_factory=list)


def summarize(answers: Sequence[Answer], servers: Sequence[str]) -> list[Row]:
    by_task: dict[tuple[str, int], Answer] = {(a.server, a.task): a for a in answers}
    rows = []
    for name in servers:
        mine = [a for a in answers if a.server == name]
        ok = [a for a in mine if not a.error]
        row = Row(name, tasks=len(ok), errors=[a.error for a in mine if a.error])
        row.tokens = sum(a.n for a in ok)
        row.tok_s = ratio(row.tokens * 1e3, sum(a.decode_ms for a in ok))
        first_to_last = sum(a.end_ms - a.ttft_ms for a in ok if a.ttft_ms is not None and a.n > 1)
        row.client_tok_s = ratio(sum(a.n - 1 for a in ok if a.n > 1) * 1e3, first_to_last)
        ttfts = [a.ttft_ms for a in ok if a.ttft_ms is not None]
        row.ttft_p50_ms, row.ttft_mean_ms = percentile(ttfts, 50), mean(ttfts)
        row.drafted = sum(a.drafted for a in ok)
        row.acceptance = ratio(sum(a.accepted for a in ok), row.drafted)
        for a in ok:
            ref = by_task.get((reference(name), a.task))
            if ref is not None and not ref.error and name != reference(name):
                row.compared += 1
                row.identical += a.text == ref.text
        rows.append(row)
    return rows


def best(rows: Sequence[Row], prefix: str, *, plain: bool = False) -> Row | None:
    """The fastest row of a family as the client sees it (``plain`` False: its speculative
    rows only)."""
    family = [r for r in rows if r.server.startswith(prefix) and r.client_tok_s is not None]
    if not plain:
        family = [r for r in family if r.server != reference(r.server)]
    return max(family, key=lambda r: r.client_tok_s or 0.0, default=None)


def table(rows: Sequence[Row]) -> str:
    plain = next((r for r in rows if r.server == PLAIN), None)
    anchor_best = best(rows, "llama-server", plain=True)
    head = (
        f"{'server':<30}{'tok/s':>8}{'server':>8}{'vs plain':>9}{'vs llama':>9}"
        f"{'TTFT p50':>10}{'accept':>8}{'identical':>11}{'tokens':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        same = f"{r.identical}/{r.compared}" if r.compared else "-"
        base = next((x for x in rows if x.server == reference(r.server)), plain)
        vs_plain = ratio(r.client_tok_s, base.client_tok_s if base else None)
        vs_llama = ratio(r.client_tok_s, anchor_best.client_tok_s if anchor_best else None)
        accept = None if r.acceptance is None else r.acceptance * 100
        lines.append(
            f"{r.server:<30}{fmt(r.client_tok_s, '.1f'):>8}{fmt(r.tok_s, '.1f'):>8}"
            f"{_times(vs_plain):>9}{_times(vs_llama):>9}{fmt(r.ttft_p50_ms, '.0f') + ' ms':>10}"
            f"{fmt(accept, '.0f') + '%' if accept is not None else '-':>8}{same:>11}{r.tokens:>8}"
        )
    lines.append(
        "(tok/s: as the client sees it, tokens after the first / the time from first to last "
        "token; server: tokens / the server's own decode time; vs plain: to the same server's "
        "plain decoding; vs llama: to the fastest llama-server row; identical: answers equal "
        "to that plain decoding)"
    )
    return "\n".join(lines)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def verdict(rows: Sequence[Row]) -> list[str]:
    """The issue's four targets, each with the measured figure (speeds as the client sees
    them; the plain reference is the same localspec configuration decoding plainly)."""
    ours = best(rows, "localspec")
    theirs = best(rows, "llama-server", plain=True)
    if ours is None:
        return ["no speculative localspec row"]
    plain = next((r for r in rows if r.server == reference(ours.server)), None)
    out = []

    def check(label: str, value: float | None, bar: float) -> None:
        passed = value is not None and value >= bar
        out.append(f"{'PASS' if passed else 'FAIL'} {label}: {fmt(value, '.2f')} (>= {bar})")

    vs_plain = ratio(ours.client_tok_s, plain.client_tok_s if plain else None)
    check(f"{ours.server} tok/s vs {plain.server if plain else 'plain'}", vs_plain, 2.0)
    if theirs is not None:
        vs_theirs = ratio(ours.client_tok_s, theirs.client_tok_s)
        check(f"{ours.server} tok/s vs {theirs.server}", vs_theirs, 1.5)
        ttft = ratio(theirs.ttft_p50_ms, ours.ttft_p50_ms)
        check(f"TTFT p50: {theirs.server} / {ours.server}", ttft, 1.0)
    same = ours.identical == ours.compared and ours.compared > 0
    out.append(
        f"{'PASS' if same else 'FAIL'} {ours.server} answers identical to plain decoding: "
        f"{ours.identical}/{ours.compared}"
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("localspec bench edit", __doc__, EPILOG)
    p.add_argument("--target", type=Path, required=True, metavar="GGUF", help="chat model file")
    p.add_argument("--draft", type=Path, metavar="GGUF", help="draft model file")
    p.add_argument("--tasks", type=int, default=8, help="edits to run (default 8)")
    p.add_argument("--n-predict", type=int, default=384, help="most tokens per answer")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--localspec-modes",
        default="off,auto",
        help="comma-separated --spec-mode values for localspec servers (off is the plain "
        "reference); after a mode, :nodraft serves without the draft model and :fa-on with "
        "flash attention (compared with off:fa-on); default off,auto",
    )
    p.add_argument(
        "--vs-llama-server",
        metavar="MODES",
        help="start $LLAMA_SERVER_BIN with the same files in these modes: plain, draft, or "
        "any llama-server --spec-type (ngram-simple, ngram-mod, ngram-map-k, ...)",
    )
    p.add_argument("--llama-server-bin", metavar="PATH", help="instead of $LLAMA_SERVER_BIN")
    p.add_argument(
        "--request",
        type=json.loads,
        default={},
        metavar="JSON",
        help="extra fields for localspec requests, e.g. '{\"speculative.n_max\": 32}'",
    )
    p.add_argument(
        "--pause",
        type=float,
        default=0.5,
        metavar="S",
        help="idle seconds before each request, so no server's leftover work (spinning "
        "threads) lands on the next one (default 0.5)",
    )
    p.add_argument("--json", type=Path, help="write every answer and the summary here")
    p.add_argument("--log-dir", type=Path, help="server logs (default: $TMPDIR)")
    p.add_argument("--load-timeout", type=float, default=600.0)
    return p


def server_specs(args: argparse.Namespace) -> list[anchor.ServerSpec]:
    serve = anchor.ServeSettings(
        target=args.target, draft=args.draft, ctx=args.ctx, threads=args.threads
    )
    specs = []
    for entry in (m.strip() for m in args.localspec_modes.split(",") if m.strip()):
        mode, *variants = entry.split(":")
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            raise ValueError(f"unknown localspec variant(s) {sorted(unknown)}: {VARIANTS}")
        files = dataclasses.replace(serve, draft=None) if "nodraft" in variants else serve
        spec = anchor.localspec_spec(files, mode)
        argv = spec.argv + (["--flash-attn", "on"] if "fa-on" in variants else [])
        name = PLAIN if entry == "off" else f"localspec/{entry}"
        specs.append(anchor.ServerSpec(name, argv, spec.port, spec.env))
    if args.vs_llama_server:
        binary = anchor.find_llama_server(args.llama_server_bin)
        for mode in (m.strip() for m in args.vs_llama_server.split(",") if m.strip()):
            specs.append(anchor.llama_server_spec(binary, serve, mode))
    return specs


def main(argv: Sequence[str] | None = None) -> int:
    return interruptible(lambda args: _main(args, argv), build_parser().parse_args(argv))


def _main(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    try:
        if not args.target.is_file():
            raise FileNotFoundError(f"model file not found: {args.target}")
        tasks = edit_tasks(args.tasks, stdlib_files())
        if not tasks:
            raise ValueError("no functions of 8-40 lines found in the standard library")
        specs = server_specs(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "localspec-bench-logs"
    answers: list[Answer] = []
    t0 = time.perf_counter()
    try:
        print(f"{len(tasks)} edits; starting {len(specs)} servers", file=sys.stderr)
        with anchor.serving(specs, log_dir, args.load_timeout, _progress):
            for i, task in enumerate(tasks):
                order = specs[i % len(specs) :] + specs[: i % len(specs)]
                line = []
                for spec in order:
                    extra = args.request if spec.name.startswith("localspec") else {}
                    time.sleep(args.pause)
                    answer = ask(spec.url, task, args.n_predict, extra)
                    answer.server, answer.task = spec.name, i
                    answers.append(answer)
                    speed = ratio(answer.n * 1e3, answer.decode_ms)
                    line.append(f"{spec.name} {fmt(speed, '.0f')}")
                print(f"[{i + 1}/{len(tasks)}] {task.kind:<12} {task.where:<36} tok/s: "
                      + ", ".join(line), file=sys.stderr, flush=True)  # fmt: skip
    except (anchor.ServerError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rows = summarize(answers, [s.name for s in specs])
    table_text = table(rows)
    print()
    print(table_text)
    print()
    print("\n".join(verdict(rows)))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; server logs in {log_dir}")
    doc = {
        "benchmark": "edit",
        "machine": harness.machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "servers": [{"name": s.name, "argv": s.argv} for s in specs],
        "tasks": [asdict(t) for t in tasks],
        "rows": [asdict(r) for r in rows],
        "verdict": verdict(rows),
        "answers": [asdict(a) for a in answers],
    }
    harness.record("edit", argv, table_text, doc, json_path=args.json)
    return 0


def _progress(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

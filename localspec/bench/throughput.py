"""``localspec bench throughput``: clients at once against localspec and llama-server.

N clients each send R greedy ``/completion`` requests at the same time (distinct standard
library prompts of about C characters, ``--n-predict`` tokens each, any slot). For every
server, background load (``--background``: busy processes beside the servers) and client
count, the report gives the aggregate generated tokens per second, the requests' latency
p50/p95, each request's prompt and decode speed from the server's own timings, and how many
answers equal the same prompt's answer alone (decoded in a batch with others, a greedy answer
may differ only where the batch's rounding flips a near tie). The servers start one at a time
with as many slots as the largest client count (llama-server ``-np N -kvu``, localspec
``--slots N``) and answer one unmeasured warm-up request each, every cell is measured for
each server in turn (the order alternating), and each figure is put beside llama-server's
from the same run. ``--chat-target`` adds a second
localspec serving an instruct model for chat beside the target, as a default ``localspec up``
does where the machine fits both; its chat model answers one chat request before each cell, so
the completions are measured after chat has run (its worker shares the completion engine's
thread, and so its llama.cpp threads).

``--context-chars N`` puts the same N characters of other files' code before every prompt, as
an editor's extra context heads its prompts, and caches that head on every slot of both
servers before each cell (and before the answers alone): a request then evaluates only its own
snippet, deep in the context, which is what a jump to another place in the code costs an
editor; each client then keeps to its own slot (``id_slot``), as an editor's session does.
Without it every prompt is evaluated in full from an empty cache, on any slot.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from localspec.bench import anchor, harness
from localspec.bench.background import TURN_GAP_S, busy_loops, levels
from localspec.bench.command import bench_parser, interruptible
from localspec.bench.corpus import code_prompts, ring_chunks
from localspec.bench.driver import divergence
from localspec.bench.stats import fmt, mean, percentile, ratio

EPILOG = """\
examples:
  # one client, idle and beside one and two busy processes, against llama-server
  localspec bench throughput --target t.gguf --clients 1 --background 0,1,2 \\
      --vs-llama-server plain --json busy.json
  # four and eight editors at once (localspec --slots 8, llama-server -np 8 -kvu)
  localspec bench throughput --target t.gguf --draft d.gguf --clients 4,8 --vs-llama-server plain
  # completions with and without a chat model beside them that has answered a chat request
  localspec bench throughput --target t.gguf --chat-target instruct.gguf --repeats 2
  # prompt evaluation deep in the context: each snippet after ~2 000 tokens of cached code
  localspec bench throughput --target t.gguf --context-chars 8000 --requests 6 --n-predict 16

llama-server comes from $LLAMA_SERVER_BIN (build it with scripts/build-llama-server.sh).
"""


@dataclass
class Request:
    """One request's outcome, as the server reported it."""

    latency_s: float
    ok: bool
    prompt_index: int = -1
    content: str = ""
    same_as_alone: bool | None = None  # None: no answer alone to compare with
    predicted_n: int = 0
    prompt_n: int = 0
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None
    error: str = ""
    # where an answer parted from its answer alone: the top-2 probability margin of the answer
    # alone at that token (a near tie when small), and whether this one took the runner-up
    parted_margin: float | None = None
    took_runner_up: bool | None = None
    cache_n: int = 0  # prompt tokens the server reused from its cache
    report: list[dict[str, Any]] = field(default_factory=list, repr=False)  # n_probs answers


@dataclass
class Cell:
    """One server at one background load and client count."""

    server: str
    background: int
    clients: int
    wall_s: float = 0.0
    requests: list[Request] = field(default_factory=list)

    @property
    def ok(self) -> list[Request]:
        return [r for r in self.requests if r.ok]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.ok)

    @property
    def aggregate_tps(self) -> float | None:
        return ratio(sum(r.predicted_n for r in self.ok), self.wall_s)

    def latency(self, q: float) -> float | None:
        return percentile([r.latency_s for r in self.ok], q)

    @property
    def decode_tps(self) -> float | None:
        return mean([r.predicted_per_second for r in self.ok if r.predicted_per_second])

    @property
    def prompt_tps(self) -> float | None:
        return mean([r.prompt_per_second for r in self.ok if r.prompt_per_second])

    @property
    def same_as_alone(self) -> float | None:
        checked = [r.same_as_alone for r in self.ok if r.same_as_alone is not None]
        return sum(checked) / len(checked) if checked else None

    @property
    def parted_margins(self) -> list[float]:
        return [r.parted_margin for r in self.ok if r.parted_margin is not None]

    def summary(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "background": self.background,
            "clients": self.clients,
            "requests": len(self.requests),
            "errors": self.errors,
            "wall_s": self.wall_s,
            "aggregate_tokens_per_s": self.aggregate_tps,
            "latency_p50_s": self.latency(50),
            "latency_p95_s": self.latency(95),
            "decode_tokens_per_s": self.decode_tps,
            "prompt_tokens_per_s": self.prompt_tps,
            "same_as_alone": self.same_as_alone,
            "parted_margins": self.parted_margins,
            "parted_took_runner_up": sum(bool(r.took_runner_up) for r in self.ok),
        }


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser("localspec bench throughput", __doc__, EPILOG)
    p.add_argument("--target", type=Path, required=True, metavar="GGUF", help="target model")
    p.add_argument("--draft", type=Path, metavar="GGUF", help="draft model (both servers)")
    p.add_argument(
        "--chat-target",
        type=Path,
        metavar="GGUF",
        help="also measure a localspec that serves this instruct model for chat beside the target",
    )
    p.add_argument("--clients", default="1", help="client counts to measure, e.g. 1,4,8")
    p.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    p.add_argument("--n-predict", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument(
        "--prompt-chars", type=int, default=1500, help="characters per prompt (default 1500)"
    )
    p.add_argument(
        "--context-chars",
        type=int,
        default=0,
        help="characters of cached code before every prompt (default 0: none, no cache)",
    )
    p.add_argument(
        "--background", default="0", help="busy processes beside the servers, e.g. 0,1,2"
    )
    p.add_argument("--threads", type=int, default=2, help="threads of both servers (default 2)")
    p.add_argument("--ctx", type=int, default=4096, help="context per slot (default 4096)")
    p.add_argument(
        "--vs-llama-server", default="plain", help="llama-server modes, e.g. plain,draft ('': none)"
    )
    p.add_argument("--spec-mode", help="localspec's speculative mode (default: its settings)")
    p.add_argument(
        "--flash-attn", choices=("on", "off"), help="localspec's flash attention (default: its own)"
    )
    p.add_argument("--no-localspec", action="store_true", help="only the llama-server modes")
    p.add_argument("--llama-server-bin", metavar="PATH", help="instead of $LLAMA_SERVER_BIN")
    p.add_argument("--repeats", type=int, default=1, help="rounds over every cell (default 1)")
    p.add_argument(
        "--no-alone", action="store_true", help="skip the answers alone (no agreement column)"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="per request, s (default 900)")
    p.add_argument("--load-timeout", type=float, default=600.0, help="model load, s")
    p.add_argument("--log-dir", type=Path, help="where started servers log (default: a tmpdir)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write results as JSON")
    return p


def prompts(n: int, chars: int) -> list[str]:
    """``n`` distinct standard-library snippets of about ``chars`` characters."""
    lines = max(4, chars // 30)
    return [text[:chars] for text in code_prompts(n, lines=lines)]


@functools.cache
def context_head(chars: int) -> str:
    """``chars`` characters of other modules' code, whole lines, the same for every prompt."""
    if chars <= 0:
        return ""
    head = ""
    for chunk in ring_chunks(n=64):
        for line in chunk["text"].splitlines(True):
            if len(head) + len(line) > chars:
                return head
            head += line
    return head


def _post(url: str, body: dict[str, Any], timeout: float) -> Request:
    t0 = time.perf_counter()
    try:
        r = httpx.post(url + "/completion", json=body, timeout=timeout)
        latency = time.perf_counter() - t0
        if r.status_code != 200:
            return Request(latency, False, error=f"{r.status_code}: {r.text[:200]}")
        answer = r.json()
        if isinstance(answer, list):
            answer = answer[0]
        t = answer.get("timings") or {}
        probs = answer.get("completion_probabilities")
        return Request(
            latency,
            True,
            content=str(answer.get("content", "")),
            predicted_n=int(t.get("predicted_n") or 0),
            prompt_n=int(t.get("prompt_n") or 0),
            cache_n=int(t.get("cache_n") or 0),
            prompt_per_second=t.get("prompt_per_second"),
            predicted_per_second=t.get("predicted_per_second"),
            report=probs if isinstance(probs, list) else [],
        )
    except (httpx.HTTPError, ValueError) as exc:
        return Request(time.perf_counter() - t0, False, error=f"{type(exc).__name__}: {exc}")


def _body(text: str, args: Any, n_probs: int = 0, id_slot: int = -1) -> dict[str, Any]:
    """A greedy request for ``text`` after the context head. Without a head every prompt is
    evaluated in full (no cache reuse between cells), so prompt speeds are comparable; with
    one, only the head may be reused (``prime`` leaves every slot holding it before a snippet
    that no measured request sends)."""
    return {"prompt": context_head(args.context_chars) + text, "n_predict": args.n_predict,
            "top_k": 1, "samplers": ["top_k"], "cache_prompt": args.context_chars > 0,
            "id_slot": id_slot, "n_probs": n_probs}  # fmt: skip


def prime(
    spec: anchor.ServerSpec, slots: int, text: str, args: Any, progress: Callable[[str], None]
) -> None:
    """With ``--context-chars``: every slot answers the head and ``text`` (a snippet no cell
    sends), so that what the last cell or the answers alone left in a slot is not reused and
    the head always is; each slot then holds what an editor's last request leaves there."""
    if args.context_chars <= 0:
        return
    for slot in range(slots):
        progress(f"{spec.name}: the context head into slot {slot}")
        r = _post(spec.url, {**_body(text, args, id_slot=slot), "n_predict": 1}, args.timeout)
        if not r.ok:
            raise anchor.ServerError(f"{spec.url} did not cache the context head: {r.error}")


def chat_once(url: str, model: str, timeout: float) -> None:
    """One short chat answer from the chat model ``model`` (its worker evaluates it)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three uses of a hash map."}],
        "max_tokens": 32,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise anchor.ServerError(f"the chat model did not answer: {r.status_code} {r.text[:200]}")


def warm_up(url: str, text: str, args: Any) -> None:
    """One request on a prompt no cell sends, not measured."""
    r = _post(url, _body(text, args), args.timeout)
    if not r.ok:
        raise anchor.ServerError(f"{url} did not answer its warm-up request: {r.error}")


def alone(url: str, texts: Sequence[str], args: Any) -> list[Request]:
    """Each prompt's answer with nothing else running, the reference for agreement, with each
    token's two likeliest candidates (``n_probs`` reports; the tokens are the same without):
    where an answer decoded beside others parts from it, how near a tie that token was."""
    return [_post(url, _body(text, args, n_probs=2), args.timeout) for text in texts]


def compare(outcome: Request, reference: Request) -> None:
    """Fill ``outcome``'s agreement with its answer alone, and where it parted, the margin."""
    if not (outcome.ok and reference.ok):
        return
    outcome.same_as_alone = outcome.content == reference.content
    if not outcome.same_as_alone:
        parted = divergence(outcome.content, reference.report)
        if parted is not None:
            outcome.parted_margin, outcome.took_runner_up = parted


def measure(
    url: str,
    name: str,
    texts: Sequence[str],
    *,
    background: int,
    clients: int,
    args: Any,
    reference: Sequence[Request] = (),
) -> Cell:
    """``clients`` threads at once, each sending its ``args.requests`` prompts in turn."""
    cell = Cell(name, background, clients)
    lock = threading.Lock()

    def client(index: int) -> None:
        for k in range(args.requests):
            i = (index * args.requests + k) % len(texts)
            # behind a cached head each client keeps to its own slot, as an editor does
            slot = index if args.context_chars > 0 else -1
            outcome = _post(url, _body(texts[i], args, id_slot=slot), args.timeout)
            outcome.prompt_index = i
            if i < len(reference):
                compare(outcome, reference[i])
            with lock:
                cell.requests.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cell.wall_s = time.perf_counter() - t0
    return cell


def table(cells: Sequence[Cell]) -> str:
    head = (
        f"{'server':<24} {'bg':>3} {'clients':>7} {'agg tok/s':>10} {'p50 s':>7} "
        f"{'p95 s':>7} {'decode tok/s':>12} {'prompt tok/s':>12} {'=alone':>6} "
        f"{'parted at':>9} {'errors':>6}  vs llama-server"
    )
    lines = [head, "-" * len(head)]
    # "parted at": the largest top-2 probability margin, in the answers alone, at a token where
    # an answer decoded beside others took another path (a near tie when small)
    for c in cells:
        anchor_cell = _anchor_for(c, cells)
        vs = ""
        if anchor_cell is not None and anchor_cell is not c:
            vs = (
                f"agg {fmt(ratio(c.aggregate_tps, anchor_cell.aggregate_tps), '.2f')}x "
                f"p50 {fmt(ratio(c.latency(50), anchor_cell.latency(50)), '.2f')}x "
                f"p95 {fmt(ratio(c.latency(95), anchor_cell.latency(95)), '.2f')}x "
                f"decode {fmt(ratio(c.decode_tps, anchor_cell.decode_tps), '.2f')}x "
                f"prompt {fmt(ratio(c.prompt_tps, anchor_cell.prompt_tps), '.2f')}x"
            )
        lines.append(
            f"{c.server:<24} {c.background:>3} {c.clients:>7} {fmt(c.aggregate_tps, '.1f'):>10} "
            f"{fmt(c.latency(50), '.2f'):>7} {fmt(c.latency(95), '.2f'):>7} "
            f"{fmt(c.decode_tps, '.1f'):>12} {fmt(c.prompt_tps, '.0f'):>12} "
            f"{fmt(None if c.same_as_alone is None else 100 * c.same_as_alone, '.0f'):>5}% "
            f"{fmt(max(c.parted_margins, default=None), '.3f'):>9} {c.errors:>6}  {vs}"
        )
    return "\n".join(lines)


def _anchor_for(cell: Cell, cells: Sequence[Cell]) -> Cell | None:
    """The first llama-server cell at the same load and client count."""
    return next(
        (
            c
            for c in cells
            if c.server.startswith("llama-server")
            and (c.background, c.clients) == (cell.background, cell.clients)
        ),
        None,
    )


def merge(cells: Sequence[Cell]) -> list[Cell]:
    """Repeated rounds of the same cell, as one (their requests together, walls summed)."""
    out: dict[tuple[str, int, int], Cell] = {}
    for c in cells:
        key = (c.server, c.background, c.clients)
        if key not in out:
            out[key] = Cell(*key)
        out[key].requests += c.requests
        out[key].wall_s += c.wall_s
    return list(out.values())


def main(argv: Sequence[str] | None = None) -> int:
    return interruptible(lambda args: _main(args, argv), build_parser().parse_args(argv))


def _main(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    try:
        client_counts = levels(args.clients)
        loads = levels(args.background)
        if 0 in client_counts or args.requests < 1:
            raise ValueError("--clients and --requests must be at least 1")
        if args.context_chars < 0:
            raise ValueError("--context-chars must be 0 or more")
        for path in (args.target, args.draft, args.chat_target):
            if path is not None and not path.is_file():
                raise ValueError(f"model file not found: {path}")
        serve = anchor.ServeSettings(
            target=args.target.resolve(),
            draft=args.draft.resolve() if args.draft else None,
            ctx=args.ctx,
            threads=args.threads,
            slots=max(client_counts),
            kv_unified=True,
            flash_attn=args.flash_attn,
            n_predict=args.n_predict,
        )
        specs = [] if args.no_localspec else [anchor.localspec_spec(serve, args.spec_mode)]
        if args.chat_target is not None and not args.no_localspec:
            chat_serve = replace(serve, chat_target=args.chat_target.resolve())
            specs.append(anchor.localspec_spec(chat_serve, args.spec_mode))
        modes = [m.strip() for m in args.vs_llama_server.split(",") if m.strip()]
        if modes:
            binary = anchor.find_llama_server(args.llama_server_bin)
            specs += [anchor.llama_server_spec(binary, serve, m) for m in modes]
        if not specs:
            raise ValueError("nothing to measure: drop --no-localspec or add --vs-llama-server")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_texts = max(client_counts) * args.requests
    *texts, warm_text = prompts(n_texts + 1, args.prompt_chars)
    log_dir = args.log_dir or Path("/tmp/localspec-bench-logs")

    def progress(msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    cells: list[Cell] = []
    try:
        with anchor.serving(specs, log_dir, args.load_timeout, progress) as started:
            for server in started:
                # a server's one-time costs stay out of the cells: llama-server warms up at
                # load; localspec's speculation tries the draft model on its first request
                # (its prompt window and drafts) before it has measured whether that pays
                progress(f"{server.spec.name}: one warm-up request")
                warm_up(server.spec.url, warm_text, args)
            reference: dict[str, list[Request]] = {}
            if not args.no_alone:
                for server in started:
                    progress(f"{server.spec.name}: each prompt alone, for the agreement column")
                    prime(server.spec, serve.slots, warm_text, args, progress)
                    reference[server.spec.name] = alone(server.spec.url, texts, args)
            n_round = 0
            for _ in range(args.repeats):
                for load in loads:
                    with busy_loops(load):
                        for clients in client_counts:
                            order = started if n_round % 2 == 0 else started[::-1]
                            n_round += 1
                            for server in order:
                                if server.spec.chat_model is not None:
                                    chat_once(server.spec.url, server.spec.chat_model, args.timeout)
                                prime(server.spec, serve.slots, warm_text, args, progress)
                                time.sleep(TURN_GAP_S)  # the last server's work out of view
                                cell = measure(
                                    server.spec.url, server.spec.name, texts,
                                    background=load, clients=clients, args=args,
                                    reference=reference.get(server.spec.name, ()),
                                )  # fmt: skip
                                cells.append(cell)
                                progress(
                                    f"{cell.server} bg {load} clients {clients}: "
                                    f"{fmt(cell.aggregate_tps, '.1f')} tok/s, "
                                    f"p50 {fmt(cell.latency(50), '.2f')} s, {cell.errors} errors"
                                )
    except (anchor.ServerError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    merged = merge(cells)
    table_text = table(merged)
    print()
    print(table_text)
    doc = {
        "benchmark": "throughput",
        "machine": harness.machine(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "servers": [{"name": s.spec.name, "argv": s.spec.argv} for s in started],
        "cells": [c.summary() for c in merged],
        "requests": [
            {"server": c.server, "background": c.background, "clients": c.clients, **asdict(r)}
            for c in cells
            for r in c.requests
        ],
    }
    harness.record("throughput", argv, table_text, doc, json_path=args.json)
    return 0 if all(c.errors == 0 for c in merged) else 1


if __name__ == "__main__":
    sys.exit(main())

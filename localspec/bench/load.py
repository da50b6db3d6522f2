"""A load test for a running daemon: N editor-like clients on loopback for a bounded time.

Each client loops over greedy ``/infill`` requests at a few places of a real source file (the
Python standard library's), cache warm-ups (``n_predict: 0``) and aborts (the connection
dropped a few milliseconds in, as llama-vscode does on every keystroke). Before the load,
every request is run alone once; under load every completed answer must equal it token for
token. The daemon's RSS is read from its own ``/metrics`` before and after.

    localspec bench load --url http://127.0.0.1:8012 --clients 32 --seconds 60

prints a table and, with ``--json FILE``, writes the figures.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from localspec.bench import corpus, harness
from localspec.bench.command import key_from_file
from localspec.bench.stats import percentile

ACTIONS = ("complete", "warmup", "abort")


def infill_bodies(n_docs: int, n_predict: int) -> list[dict[str, Any]]:
    """Greedy /infill requests at ``n_docs`` places of textwrap.py, with a ring buffer."""
    source = corpus.source_lines("textwrap.py")
    ring = corpus.ring_chunks(
        8, 6, names=("json/decoder.py",), stride=6, filename="/proj/mod{i}.py"
    )
    bodies = []
    for doc in range(n_docs):
        cut = 40 + 23 * doc
        bodies.append(
            {
                "input_prefix": "".join(source[max(0, cut - 40) : cut]),
                "input_suffix": "".join(source[cut + 1 : cut + 12]),
                "input_extra": ring,
                "prompt": source[cut][: len(source[cut]) // 2],
                "n_predict": n_predict,
                "top_k": 1,
                "samplers": ["top_k"],
                "t_max_predict_ms": 0,
            }
        )
    return bodies


@dataclass
class LoadReport:
    clients: int
    seconds: float
    completed: int = 0
    warmups: int = 0
    aborted: int = 0
    busy_503: int = 0
    errors: int = 0  # any other non-200, or a transport error on a request not aborted
    mismatches: int = 0  # completed greedy answers that differ from the request run alone
    status: dict[str, int] = field(default_factory=dict)
    latency_ms_p50: float = 0.0
    latency_ms_p95: float = 0.0
    latency_ms_alone_p50: float = 0.0
    rss_before_mb: float = 0.0  # after warm-up
    rss_after_mb: float = 0.0
    rss_growth: float = 0.0
    busy_slots_after: int = 0
    queue_after: int = 0
    error_samples: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            ("clients x seconds", f"{self.clients} x {self.seconds:g}"),
            ("completed / warm-ups / aborted",
             f"{self.completed} / {self.warmups} / {self.aborted}"),
            ("503 busy (retried)", str(self.busy_503)),
            ("errors / mismatches", f"{self.errors} / {self.mismatches}"),
            ("latency p50 / p95 (alone p50)",
             f"{self.latency_ms_p50:.0f} / {self.latency_ms_p95:.0f} ms "
             f"({self.latency_ms_alone_p50:.0f} ms)"),
            ("RSS after warm-up -> end",
             f"{self.rss_before_mb:.1f} -> {self.rss_after_mb:.1f} MB "
             f"({self.rss_growth * 100:+.2f} %)"),
            ("busy slots / queue after", f"{self.busy_slots_after} / {self.queue_after}"),
        ]  # fmt: skip
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def scrape(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{name} is not in /metrics (metrics off, or not Linux?)")
    return float(match.group(1))


def run_load(
    url: str,
    *,
    clients: int = 16,
    seconds: float = 15.0,
    n_docs: int = 6,
    n_predict: int = 8,
    warmup_fraction: float = 0.25,
    headers: dict[str, str] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> LoadReport:
    """Run the load against ``url`` and measure; raises if the daemon does not answer."""
    headers = headers or {}
    bodies = infill_bodies(n_docs, n_predict)
    report = LoadReport(clients=clients, seconds=seconds)
    with httpx.Client(base_url=url, headers=headers, timeout=120) as admin:
        alone: list[list[int]] = []
        alone_ms: list[float] = []
        for n, body in enumerate(bodies, 1):  # each request run alone: the answers to match
            if progress is not None:
                progress(f"  reference answer {n}/{len(bodies)}, each request alone ...")
            t0 = time.perf_counter()
            r = admin.post("/infill", json=body)
            alone_ms.append((time.perf_counter() - t0) * 1e3)
            r.raise_for_status()
            alone.append(r.json()["tokens"])
        report.latency_ms_alone_p50 = percentile(alone_ms, 50) or 0.0

        lock = threading.Lock()
        latencies: list[float] = []
        counts: Counter[str] = Counter()
        stop_at = time.monotonic() + seconds

        def note(key: str, sample: str | None = None) -> None:
            with lock:
                counts[key] += 1
                if sample and len(report.error_samples) < 10:
                    report.error_samples.append(sample)

        def client_loop(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
                while time.monotonic() < stop_at:
                    action = rng.choices(ACTIONS, weights=(6, 2, 2))[0]
                    doc = rng.randrange(len(bodies))
                    body = dict(bodies[doc])
                    timeout: float | httpx.Timeout = 120
                    if action == "warmup":
                        body["n_predict"] = 0
                    elif action == "abort":
                        body["n_predict"] = 64
                        timeout = httpx.Timeout(120, read=rng.uniform(0.002, 0.05))
                    t0 = time.perf_counter()
                    try:
                        r = c.post("/infill", json=body, timeout=timeout)
                    except httpx.TimeoutException:
                        note("aborted" if action == "abort" else "errors", f"{action}: timeout")
                        continue
                    except httpx.TransportError as exc:
                        note("errors", f"{action}: {type(exc).__name__}: {exc}")
                        continue
                    ms = (time.perf_counter() - t0) * 1e3
                    with lock:
                        report.status[str(r.status_code)] = (
                            report.status.get(str(r.status_code), 0) + 1
                        )
                    if r.status_code == 503:
                        note("busy_503")
                        time.sleep(min(float(r.headers.get("Retry-After", "1")), 0.1))
                        continue
                    if r.status_code != 200:
                        note("errors", f"{action}: {r.status_code} {r.text[:200]}")
                        continue
                    if action == "warmup":
                        note("warmups")
                    elif action == "abort":
                        note("aborted_late")  # finished before the client gave up
                    else:
                        note("completed")
                        with lock:
                            latencies.append(ms)
                        if r.json()["tokens"] != alone[doc]:
                            note("mismatches", f"doc {doc}: {r.json()['content']!r}")

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(seconds * warmup_fraction)
        report.rss_before_mb = scrape(admin, "process_resident_memory_bytes") / 2**20
        while progress is not None and time.monotonic() < stop_at:
            time.sleep(min(5.0, max(0.0, stop_at - time.monotonic())))
            with lock:
                done = dict(counts)
            left = max(0.0, stop_at - time.monotonic())
            progress(
                f"{left:3.0f} s left: {done.get('completed', 0)} completed, "
                f"{done.get('aborted', 0)} aborted, {done.get('errors', 0)} errors"
            )
        for t in threads:
            t.join(seconds + 300)
        hung = sum(t.is_alive() for t in threads)
        if hung:
            raise RuntimeError(f"{hung} clients still waiting 300 s after the end: deadlock?")
        report.rss_after_mb = scrape(admin, "process_resident_memory_bytes") / 2**20
        report.rss_growth = report.rss_after_mb / report.rss_before_mb - 1
        deadline = time.monotonic() + 30
        while True:  # aborted requests may still be winding down for a step
            report.busy_slots_after = int(scrape(admin, 'localspec_slots{state="processing"}'))
            report.queue_after = int(scrape(admin, "localspec_queue_depth"))
            if (report.busy_slots_after == 0 and report.queue_after == 0) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.05)
        final = admin.post("/infill", json=bodies[0])  # still serving, still exact
        if final.status_code != 200 or final.json()["tokens"] != alone[0]:
            counts["mismatches"] += 1
            report.error_samples.append(f"after the load: {final.status_code} {final.text[:200]}")
    report.completed = counts["completed"]
    report.warmups = counts["warmups"]
    report.aborted = counts["aborted"] + counts["aborted_late"]
    report.busy_503 = counts["busy_503"]
    report.errors = counts["errors"]
    report.mismatches = counts["mismatches"]
    if latencies:
        report.latency_ms_p50 = percentile(latencies, 50) or 0.0
        report.latency_ms_p95 = percentile(latencies, 95) or 0.0
    return report


def main(argv: list[str] | None = None) -> int:
    # no abbreviations: `--api-key KEY` must be refused, not read as --api-key-file
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--url", default="http://127.0.0.1:8012")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--n-predict", type=int, default=8)
    parser.add_argument(
        "--api-key-file", type=Path, default=None, metavar="FILE",
        help="the daemon's key (mode 600; a key on the command line would show in ps)",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    api_key = key_from_file(args.api_key_file)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    print(f"{args.clients} clients for {args.seconds:g} s against {args.url} ...", file=sys.stderr)
    report = run_load(
        args.url,
        clients=args.clients,
        seconds=args.seconds,
        n_predict=args.n_predict,
        headers=headers,
        progress=lambda line: print(line, file=sys.stderr),
    )
    table_text = report.table()
    print(table_text)
    harness.record("load", argv, table_text, asdict(report), json_path=args.json)
    ok = report.errors == 0 and report.mismatches == 0 and report.busy_slots_after == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

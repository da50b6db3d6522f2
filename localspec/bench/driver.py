"""Replays a :class:`~localspec.bench.editor.Schedule` against servers, as the editor would.

Each request is one ``/infill`` POST; when the next keystroke's time comes first, the request
is aborted by closing its connection (llama-vscode's AbortController), and the next one is
sent. Warm-ups are fire-and-forget, as in llama.vim.

Servers are interleaved location by location (one burst on each server, alternating which
goes first), not keystroke by keystroke: within a burst a server lives with its own
consequences (an aborted request still occupies it until it notices the abort), which is the
latency the user sees; between bursts every server is idle, so no server's leftovers are
charged to another on the shared cores.

Time is compressed: whenever nothing is in flight, the clock jumps to the next scheduled send
(the server cannot tell an idle second from an idle microsecond), so a replay takes roughly
the servers' busy time, not the typist's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from localspec.bench.background import TURN_GAP_S
from localspec.bench.editor import Burst, KeyKind, Schedule

Status = Literal["ok", "aborted", "error"]
ColdMode = Literal["none", "final", "pauses", "all"]


@dataclass
class Outcome:
    """What one request cost and returned (timings as the server reported them)."""

    server: str
    burst: int
    key: int  # index within the burst; -1 for warm-ups
    kind: KeyKind | Literal["warmup", "setup", "meter"]  # meter: a burst's prompt work
    status: Status
    latency_ms: float
    content: str = ""
    stop_type: str = ""
    prompt_n: int | None = None
    cache_n: int | None = None
    tokens_cached: int | None = None
    tokens_evaluated: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    server_timing: dict[str, float] = field(default_factory=dict)
    # n_cmpl > 1: each completion's generated tokens (the first is predicted_n)
    cmpl_predicted: list[int] = field(default_factory=list)
    backend: str = ""  # a localspec in front of a team server: who answered (upstream, local)
    budget: bool = False  # answered from the nearest lines within t_max_prompt_ms (localspec)
    error: str = ""
    # n_probs' report (completion_probabilities), kept for the cold probes only
    probabilities: list[dict[str, Any]] | None = None
    cold: ColdCheck | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ColdCheck:
    """The same request answered with the slot cache cleared (``cache_prompt: false``)."""

    status: Status
    latency_ms: float
    content: str = ""
    stop_type: str = ""
    prompt_n: int | None = None
    identical: bool = False  # byte-identical answer
    consistent: bool = False  # identical, or one is a prefix of the other cut by a limit
    error: str = ""
    # Where the answers part (the cold answer's top two candidates, n_probs), the cold
    # model's own confidence: top-1 minus top-2 probability. Near 0: the two evaluations
    # disagree on a near tie, which any difference in rounding decides.
    margin: float | None = None
    runner_up: bool | None = None  # the answer took the cold model's second choice there
    typical_margin: float | None = None  # the cold answer's median margin over its tokens
    probabilities: list[dict[str, Any]] | None = None  # the cold answer's n_probs report


def _parse_server_timing(header: str | None) -> dict[str, float]:
    """``queue;dur=1.2, engine;dur=30`` → {"queue": 1.2, "engine": 30.0}."""
    out: dict[str, float] = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            with contextlib.suppress(ValueError):
                out[name] = float(rest[4:])
    return out


def _fill(outcome: Outcome, answer: Any) -> None:
    if isinstance(answer, list):  # n_cmpl > 1: an array, the first completion stands for all
        outcome.cmpl_predicted = [
            int((a.get("timings") or {}).get("predicted_n") or 0)
            for a in answer
            if isinstance(a, dict)
        ]
        answer = answer[0] if answer else {}
    if not isinstance(answer, dict):
        outcome.status, outcome.error = "error", f"unexpected answer: {str(answer)[:200]}"
        return
    timings = answer.get("timings") or {}
    outcome.content = str(answer.get("content", ""))
    outcome.stop_type = str(answer.get("stop_type", ""))
    outcome.tokens_cached = answer.get("tokens_cached")
    outcome.budget = bool((answer.get("prompt_budget") or {}).get("used"))
    outcome.tokens_evaluated = answer.get("tokens_evaluated")
    outcome.prompt_n = timings.get("prompt_n")
    outcome.cache_n = timings.get("cache_n")
    outcome.prompt_ms = timings.get("prompt_ms")
    outcome.predicted_n = timings.get("predicted_n")
    outcome.predicted_ms = timings.get("predicted_ms")
    outcome.draft_n = timings.get("draft_n")
    outcome.draft_n_accepted = timings.get("draft_n_accepted")
    probs = answer.get("completion_probabilities")
    outcome.probabilities = probs if isinstance(probs, list) else None


def answers_consistent(a: str, a_stop: str, b: str, b_stop: str) -> bool:
    """Equal, or the shorter is a prefix of the longer and was cut by a limit.

    ``t_max_predict_ms`` and ``n_indent`` stop an answer at a point that depends on timing,
    so two evaluations producing the same tokens can still end at different lengths.
    """
    if a == b:
        return True
    if len(a) > len(b):
        a, a_stop, b, b_stop = b, b_stop, a, a_stop
    return a_stop == "limit" and b.startswith(a)


def _margin(entry: dict[str, Any]) -> float | None:
    top = entry.get("top_logprobs") or []
    if len(top) < 2:
        return None
    return math.exp(top[0]["logprob"]) - math.exp(top[1]["logprob"])


def divergence(answer: str, cold: Sequence[dict[str, Any]]) -> tuple[float, bool] | None:
    """Where ``answer`` leaves the cold answer, token by token (``cold`` is its n_probs
    report): the cold model's margin there and whether ``answer`` took its second choice.
    None when ``answer`` follows the cold tokens to its end, or the report has no runner-up.
    """
    want = answer.encode("utf-8")
    done = b""
    for i, entry in enumerate(cold):
        rest = want[len(done) :]
        piece = bytes(entry.get("bytes") or [])
        if not rest or (piece and piece.startswith(rest)):
            return None  # the answer ends on the cold path (cut shorter)
        if piece and rest.startswith(piece):
            done += piece
            continue
        if not piece and i < len(cold) - 1:
            continue  # a control token renders nothing mid-answer
        margin = _margin(entry)  # parted here (or the cold answer ended where this goes on)
        if margin is None:
            return None
        second = bytes(entry["top_logprobs"][1].get("bytes") or [])
        return margin, bool(second) and rest.startswith(second)
    return None


class Target:
    """One server under test: a name, a base URL and its HTTP client.

    ``oracle``: where its cold-cache checks go: a twin with the same model and settings. A
    check sent to the server itself leaves the cold evaluation's exact KV in its slot, so the
    next location would start from a cache that no editor session has."""

    def __init__(
        self,
        name: str,
        url: str,
        api_key: str | None = None,
        oracle: Target | None = None,
        *,
        meter: bool = True,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.oracle = oracle
        self.meter = meter  # False: its /metrics counts no prompt work (a proxy's do not)
        # body fields this server's requests carry instead of the schedule's (``n_cmpl`` 1 on
        # a twin: the same keystrokes with one completion each)
        self.overrides = overrides or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(None, connect=10.0)
        )

    async def post(self, body: dict[str, Any], outcome: Outcome) -> Outcome:
        """POST /infill and fill ``outcome``; cancellation aborts the connection."""
        t0 = time.perf_counter()
        try:
            r = await self.http.post("/infill", json={**body, **self.overrides})
        except httpx.HTTPError as exc:
            outcome.status, outcome.error = "error", f"{type(exc).__name__}: {exc}"
            outcome.latency_ms = (time.perf_counter() - t0) * 1e3
            return outcome
        outcome.latency_ms = (time.perf_counter() - t0) * 1e3
        outcome.server_timing = _parse_server_timing(r.headers.get("server-timing"))
        outcome.backend = r.headers.get("x-localspec-backend", "")
        if r.status_code != 200:
            outcome.status, outcome.error = "error", f"HTTP {r.status_code}: {r.text[:300]}"
            return outcome
        try:
            _fill(outcome, r.json())
        except ValueError as exc:
            outcome.status, outcome.error = "error", f"bad JSON: {exc}"
        return outcome

    async def prompt_work(self) -> float | None:
        """The server's own count of prompt tokens evaluated so far (``/metrics``), aborted
        requests included; None when it does not expose one."""
        if not self.meter:
            return None
        try:
            r = await self.http.get("/metrics")
        except httpx.HTTPError:
            return None
        return prompt_tokens_metric(r.text) if r.status_code == 200 else None

    async def aclose(self) -> None:
        await self.http.aclose()
        if self.oracle is not None:
            await self.oracle.aclose()


# prompt tokens evaluated, excluding cached ones, every request counted: localspec's engine
# counter and llama-server's (started with --metrics)
PROMPT_WORK_METRICS = ("localspec_engine_prompt_tokens_total", "llamacpp:prompt_tokens_total")


def prompt_tokens_metric(text: str) -> float | None:
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in PROMPT_WORK_METRICS:
                    return sample.value
    except ValueError:  # not Prometheus text
        return None
    return None


class _Clock:
    """Simulated typist time that skips ahead whenever no request is in flight."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.skipped = 0.0
        self.inflight: set[asyncio.Task[Outcome]] = set()

    def now(self) -> float:
        return time.perf_counter() - self.t0 + self.skipped

    async def until(self, when: float) -> None:
        while True:
            self.inflight = {t for t in self.inflight if not t.done()}
            left = when - self.now()
            if left <= 0:
                return
            if not self.inflight:
                self.skipped += left
                return
            await asyncio.wait(self.inflight, timeout=left, return_when=asyncio.FIRST_COMPLETED)


async def _abort(task: asyncio.Task[Outcome]) -> None:
    """Cancel a request (httpx closes its connection) and wait until it is gone.

    ``asyncio.wait`` rather than ``await task``: a cancellation of the replay itself (Ctrl-C)
    must propagate, not be swallowed with the request's own CancelledError.
    """
    task.cancel()
    await asyncio.wait({task})


async def run_burst(target: Target, burst: Burst) -> list[Outcome]:
    """One location on one server: warm-ups in the idle time, then the keystrokes."""
    clock = _Clock()
    warmups: list[asyncio.Task[Outcome]] = []
    results: list[Outcome] = []
    for i, body in enumerate(burst.warmups):
        await clock.until(float(i))
        out = Outcome(target.name, burst.index, -1, "warmup", "ok", 0.0)
        task = asyncio.create_task(target.post(body, out))
        warmups.append(task)
        clock.inflight.add(task)
    send_at = burst.idle_s
    for k, key in enumerate(burst.keys):
        await clock.until(send_at)
        out = Outcome(target.name, burst.index, k, key.kind, "ok", 0.0)
        sent = time.perf_counter()
        task = asyncio.create_task(target.post(key.body, out))
        clock.inflight.add(task)
        send_at += key.wait_s
        await clock.until(send_at)
        if not task.done():
            await _abort(task)
            out.status = "aborted"
            out.latency_ms = (time.perf_counter() - sent) * 1e3
        results.append(task.result() if not task.cancelled() else out)
    for task in warmups:  # not aborted, as in the editor: wait for them before moving on
        results.append(await task)
    return results


def _wants_cold(outcome: Outcome, mode: ColdMode) -> bool:
    if outcome.status != "ok" or mode == "none" or outcome.kind in ("warmup", "setup", "meter"):
        return False
    if mode == "all":
        return True
    if mode == "pauses":
        return outcome.kind in ("pause", "final")
    return outcome.kind == "final"


def cold_body(body: dict[str, Any], answer: Outcome) -> dict[str, Any]:
    """``body`` as its cold-cache check: the cache off, n_probs on, and no clock.

    ``t_max_predict_ms`` ends an answer at the first newline past a deadline, so where it
    ends depends on how fast that evaluation ran, not on what it computed: two cold
    evaluations of one request can differ in length. The check runs without the deadline,
    and an answer a limit cut (the deadline, ``n_predict`` or ``n_indent``, all ``limit``)
    pins its length: the cold evaluation predicts as many tokens. Identity then compares
    every token of the answer, whichever evaluation was the faster one."""
    # (the first completion only: it has the body's own seed, the others count up from it)
    cold = {**body, "cache_prompt": False, "n_probs": 2, "t_max_predict_ms": 0, "n_cmpl": 1}
    if answer.stop_type == "limit" and answer.predicted_n:
        cold["n_predict"] = answer.predicted_n
    return cold


async def cold_check(
    target: Target, burst: Burst, outcomes: Sequence[Outcome], mode: ColdMode
) -> None:
    """Re-send chosen requests with the cache off (to the target's oracle when it has one)
    and compare the answers."""
    checker = target.oracle or target
    for out in outcomes:
        if out.server != target.name or not _wants_cold(out, mode):
            continue
        body = cold_body(burst.keys[out.key].body, out)
        probe = Outcome(target.name, burst.index, out.key, out.kind, "ok", 0.0)
        await checker.post(body, probe)
        report = probe.probabilities or []
        parted = divergence(out.content, report) if probe.content != out.content else None
        margins = [m for m in map(_margin, report) if m is not None]
        out.cold = ColdCheck(
            status=probe.status,
            latency_ms=probe.latency_ms,
            content=probe.content,
            stop_type=probe.stop_type,
            prompt_n=probe.prompt_n,
            identical=probe.status == "ok" and probe.content == out.content,
            consistent=probe.status == "ok"
            and answers_consistent(out.content, out.stop_type, probe.content, probe.stop_type),
            error=probe.error,
            margin=parted[0] if parted else None,
            runner_up=parted[1] if parted else None,
            typical_margin=statistics.median(margins) if margins else None,
            probabilities=probe.probabilities,
        )


async def replay(
    targets: Sequence[Target],
    schedule: Schedule,
    *,
    cold: ColdMode = "final",
    cold_servers: Collection[str] | None = None,
    progress: Callable[[int, Burst, list[Outcome]], None] | None = None,
) -> list[Outcome]:
    """The whole schedule on every target, interleaved burst by burst.

    ``cold_servers`` limits the cold-cache re-evaluations (a full prompt each) to those
    servers; None checks every server.
    """
    outcomes: list[Outcome] = []
    for target in targets:  # the ring's first fill: a cold prefill nobody types through
        setup = Outcome(target.name, -1, -1, "setup", "ok", 0.0)
        outcomes.append(await target.post(schedule.setup, setup))
    for burst in schedule.bursts:
        order = list(targets) if burst.index % 2 == 0 else list(reversed(targets))
        done: list[Outcome] = []
        for target in order:
            await asyncio.sleep(TURN_GAP_S)  # the last server's work out of the thread rule's view
            before = await target.prompt_work()
            got = await run_burst(target, burst)
            after = await target.prompt_work()  # every request of the burst has ended
            if before is not None and after is not None:
                meter = Outcome(target.name, burst.index, -1, "meter", "ok", 0.0)
                meter.prompt_n = int(after - before)
                got.append(meter)
            if cold_servers is None or target.name in cold_servers:
                await cold_check(target, burst, got, cold)
            done.extend(got)
        outcomes.extend(done)
        if progress is not None:
            progress(burst.index, burst, done)
    return outcomes

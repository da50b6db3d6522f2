"""The team-backend benchmarks, on top of the editor replay (``bench replay --via-proxy``,
``--failover``):

- **added latency**: the same keystrokes through a localspec whose backend is the measured
  server (``backend.kind = llama-server``) and to that server directly, in one interleaved
  run. Two figures: the paired difference of the two latencies (noisy: each side computes
  its own answer), and per request through the proxy its latency minus the upstream's round
  trip as the proxy timed it (``Server-Timing: upstream``, request sent to answer read: what
  the editor would have waited talking to the upstream itself): what the proxy adds, without
  the run-to-run noise of the computation.
- **failover**: the replay through a proxy with a local fallback; the team server is killed
  halfway through the locations and started again at three quarters. Every request must
  still be answered (the ``x-localspec-backend`` header says by whom), and the proxy must go
  back to the team server once it returns (how long that took is measured from the moment the
  restarted server is ready).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from localspec.bench.anchor import ManagedServer, ServerSpec, ServeSettings, free_port
from localspec.bench.driver import Outcome
from localspec.bench.stats import fmt, percentile
from localspec.planning.team import UNIFIED_KV

PROXY = "proxy"
PROXY_SLOT = 1  # the upstream slot the proxy pins; the direct replay uses slot 0


def proxy_spec(
    upstream_url: str,
    serve: ServeSettings,
    *,
    local: bool = False,
    name: str = PROXY,
    health_interval_s: float = 0.5,
) -> ServerSpec:
    """A localspec daemon whose backend is ``upstream_url`` (its own slot there), with the
    same model as a local fallback when ``local``."""
    port = free_port()
    argv = [
        sys.executable, "-m", "localspec", "up",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-requests",
        "--set", "backend.kind=llama-server",
        "--set", f"backend.url={upstream_url}",
        "--set", f"backend.slot={PROXY_SLOT}",
        "--set", f"backend.health_interval_s={health_interval_s}",
        "--set", f"backend.fallback={'local' if local else 'none'}",
    ]  # fmt: skip
    if local:
        argv += ["--target", str(serve.target), "--ctx-size", str(serve.ctx)]
        argv += ["--threads", str(serve.threads), "--cache-reuse", str(serve.cache_reuse)]
    return ServerSpec(name, argv, port)


def two_slots(team: ServerSpec) -> None:
    """Give the team server a second slot (the proxy's; the direct replay keeps slot 0):
    localspec ``--slots 2``; llama-server ``-np 2 -kvu``, every slot the whole context."""
    if "-np" in team.argv:
        team.argv[team.argv.index("-np") + 1] = "2"
        team.argv += UNIFIED_KV  # as the team plan runs it
    else:
        team.argv += ["--slots", "2"]


# ------------------------------------------------------------------ added latency


@dataclass
class Overhead:
    """What the proxy adds to each editor request (ms)."""

    n: int = 0
    hop_p50_ms: float | None = None  # latency - the upstream's round trip, per request
    hop_p95_ms: float | None = None
    hop_max_ms: float | None = None
    paired_n: int = 0
    paired_p50_ms: float | None = None  # proxy latency - direct latency, same keystroke
    paired_p95_ms: float | None = None
    direct_p50_ms: float | None = None
    proxy_p50_ms: float | None = None
    target_p50_ms: float = 5.0

    @property
    def met(self) -> bool:
        return self.hop_p50_ms is not None and self.hop_p50_ms <= self.target_p50_ms


def overhead(outcomes: Sequence[Outcome], direct: str, proxy: str = PROXY) -> Overhead:
    def keyed(name: str) -> dict[tuple[int, int], Outcome]:
        return {
            (o.burst, o.key): o
            for o in outcomes
            if o.server == name and o.key >= 0 and o.status == "ok"
        }

    mine, theirs = keyed(proxy), keyed(direct)
    hops = [  # every answered request: keystrokes and ring warm-ups
        o.latency_ms - o.server_timing["upstream"]
        for o in outcomes
        if o.server == proxy and o.status == "ok" and "upstream" in o.server_timing
    ]
    paired = [mine[k].latency_ms - theirs[k].latency_ms for k in mine if k in theirs]
    return Overhead(
        n=len(hops),
        hop_p50_ms=percentile(hops, 50),
        hop_p95_ms=percentile(hops, 95),
        hop_max_ms=max(hops) if hops else None,
        paired_n=len(paired),
        paired_p50_ms=percentile(paired, 50),
        paired_p95_ms=percentile(paired, 95),
        direct_p50_ms=percentile([o.latency_ms for o in theirs.values()], 50),
        proxy_p50_ms=percentile([o.latency_ms for o in mine.values()], 50),
    )


def overhead_table(o: Overhead) -> str:
    verdict = "met" if o.met else "NOT met"
    return "\n".join(
        [
            "added latency through the proxy (ms)",
            f"  per request, latency - the upstream's round trip: p50 {fmt(o.hop_p50_ms, '.2f')} "
            f"p95 {fmt(o.hop_p95_ms, '.2f')} max {fmt(o.hop_max_ms, '.2f')} over {o.n} "
            f"answers (target p50 <= {o.target_p50_ms:g}: {verdict})",
            f"  paired keystrokes, proxy - direct: p50 {fmt(o.paired_p50_ms, '.2f')} "
            f"p95 {fmt(o.paired_p95_ms, '.2f')} over {o.paired_n}",
            f"  p50 latency: direct {fmt(o.direct_p50_ms, '.1f')}, through the proxy "
            f"{fmt(o.proxy_p50_ms, '.1f')}",
        ]
    )


# ------------------------------------------------------------------ failover


@dataclass
class Phase:
    name: str
    bursts: tuple[int, int]  # [first, last) burst index
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    by: dict[str, int] = field(default_factory=dict)  # completed, by who answered
    p50_ms: float | None = None
    p95_ms: float | None = None


@dataclass
class FailoverRun:
    """Kills the team server after ``kill_after`` bursts, starts it again after
    ``restart_after``; measures how long the proxy takes to notice each."""

    upstream: ManagedServer
    proxy_url: str
    kill_after: int
    restart_after: int
    load_timeout_s: float = 600.0
    down_noticed_s: float | None = None  # kill -> /props says down (the checker; requests
    back_s: float | None = None  # notice at once) · restarted and ready -> answering upstream
    events: list[str] = field(default_factory=list)

    def __call__(self, index: int) -> None:
        """After burst ``index`` (the replay's progress hook)."""
        if index + 1 == self.kill_after:
            assert self.upstream.proc is not None
            self.upstream.proc.kill()
            self.upstream.proc.wait(30)
            t0 = time.monotonic()
            self.down_noticed_s = _until(self.proxy_url, "down") - t0
            self.events.append(f"team server killed after location {index + 1}")
        elif index + 1 == self.restart_after:
            self.upstream.start()
            self.upstream.wait_ready(self.load_timeout_s)
            t0 = time.monotonic()
            self.back_s = _until(self.proxy_url, "up") - t0
            self.events.append(f"team server back after location {index + 1}")

    def phases(self, n_bursts: int) -> list[Phase]:
        return [
            Phase("team server up", (0, self.kill_after)),
            Phase("team server down", (self.kill_after, self.restart_after)),
            Phase("team server back", (self.restart_after, n_bursts)),
        ]


def _until(proxy_url: str, status: str, timeout: float = 60.0) -> float:
    """When the proxy's /props first shows the upstream in ``status`` (monotonic time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            backend = httpx.get(proxy_url + "/props", timeout=5).json().get("backend") or {}
        except (httpx.HTTPError, ValueError):
            backend = {}
        if backend.get("status") == status:
            return time.monotonic()
        time.sleep(0.02)
    raise TimeoutError(f"the proxy did not see the team server {status} within {timeout:g} s")


def failover_phases(outcomes: Sequence[Outcome], run: FailoverRun, n_bursts: int) -> list[Phase]:
    phases = run.phases(n_bursts)
    for phase in phases:
        lo, hi = phase.bursts
        mine = [o for o in outcomes if lo <= o.burst < hi and o.kind not in ("meter", "setup")]
        ok = [o for o in mine if o.status == "ok"]
        phase.sent = len(mine)
        phase.completed = len(ok)
        phase.aborted = sum(1 for o in mine if o.status == "aborted")
        phase.errors = sum(1 for o in mine if o.status == "error")
        for o in ok:
            phase.by[o.backend or "?"] = phase.by.get(o.backend or "?", 0) + 1
        phase.p50_ms = percentile([o.latency_ms for o in ok], 50)
        phase.p95_ms = percentile([o.latency_ms for o in ok], 95)
    return phases


def failover_table(phases: Sequence[Phase], run: FailoverRun) -> str:
    header = f"  {'phase':<20}{'sent':>6}{'ok':>6}{'aborted':>9}{'errors':>8}"
    header += f"{'by upstream':>13}{'by local':>10}{'p50 ms':>8}{'p95 ms':>8}"
    lines = ["failover: the team server killed, then started again", header]
    for p in phases:
        lines.append(
            f"  {p.name:<20}{p.sent:>6}{p.completed:>6}{p.aborted:>9}{p.errors:>8}"
            f"{p.by.get('upstream', 0):>13}{p.by.get('local', 0):>10}"
            f"{fmt(p.p50_ms, '.1f'):>8}{fmt(p.p95_ms, '.1f'):>8}"
        )
    lines.append(
        f"  the proxy saw it down {fmt(run.down_noticed_s, '.2f')} s after the kill (its "
        f"requests failed over at once); back on the team server "
        f"{fmt(run.back_s, '.2f')} s after it was ready again"
    )
    return "\n".join(lines)


def to_json(value: Any) -> Any:
    return asdict(value)

"""Prometheus metrics for the daemon, in a registry of its own (one per app, none global).

Counters and histograms are updated as requests finish; everything that is state (queue depth,
slots, model memory, acceptance) is read at scrape time by collectors, so the worker thread
never blocks on the metrics and a scrape always shows the present.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from localspec.engine.hostcache import HostCache
from localspec.engine.slot import Slot
from localspec.engine.types import GenerationResult

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
_RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 5000, 20000)

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class Probes:
    """What the metrics read from the daemon at scrape time (all cheap, none blocking)."""

    queued: Callable[[], int]
    busy: Callable[[], bool]
    cancelled: Callable[[], int] = lambda: 0
    prompt_evaluated: Callable[[], int] = lambda: 0  # by the engine, cut-short requests too
    slots: Callable[[], Sequence[Slot]] = lambda: ()
    model_files: Callable[[], dict[str, str]] = dict  # role ("target", "draft") -> GGUF path
    # (cores the engine's evaluations may use now, cores other processes keep busy); None
    # when the engine does not follow the load
    cpu: Callable[[], tuple[int, float] | None] = lambda: None
    # the target's KV buffer: (cells freed below kept ones, compactions so far); None before
    # a model is loaded
    kv: Callable[[], tuple[int, int] | None] = lambda: None
    # the host-memory cache of slot contexts (engine/hostcache.py); None: off or not loaded
    host_cache: Callable[[], HostCache | None] = lambda: None
    # contexts restored from files, by source (Restores.totals)
    restores: Callable[[], Mapping[str, RestoreTotal]] = dict


@dataclass(frozen=True)
class RestoreTotal:
    """What one source restored so far."""

    contexts: int = 0
    tokens: int = 0
    seconds: float = 0.0


class Restores:
    """Slot contexts read back from a file instead of evaluated, by source: ``slot_file``
    (``POST /slots/{id}?action=restore``) and ``restart`` (kept at the last clean shutdown,
    server/keep.py). The host cache counts its own restores (``host_cache`` in /metrics).
    Added to from the event loop and the engine's thread, read by scrapes: under a lock."""

    SOURCES = ("slot_file", "restart")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = {source: RestoreTotal() for source in self.SOURCES}

    def add(self, source: str, tokens: int, seconds: float) -> None:
        """One context of ``tokens`` tokens restored in ``seconds`` (reading and checking the
        file included)."""
        with self._lock:
            t = self._totals[source]
            self._totals[source] = RestoreTotal(
                t.contexts + 1, t.tokens + tokens, t.seconds + seconds
            )

    def totals(self) -> dict[str, RestoreTotal]:
        with self._lock:
            return dict(self._totals)


class _StateCollector(Collector):
    """Queue, engine, slots, model memory, cancellations and acceptance, read when scraped."""

    def __init__(self, probes: Probes, metrics: Metrics) -> None:
        self.probes = probes
        self.metrics = metrics
        self._sizes: dict[str, int] = {}

    def _model_bytes(self) -> dict[str, int]:
        files = self.probes.model_files()
        for role, path in files.items():
            if role not in self._sizes:
                try:
                    self._sizes[role] = os.path.getsize(path)
                except OSError:
                    continue
        return {role: size for role, size in self._sizes.items() if role in files}

    def collect(self) -> Iterable[Metric]:
        p = self.probes
        yield GaugeMetricFamily(
            "localspec_queue_depth", "Requests waiting for the engine", value=p.queued()
        )
        yield GaugeMetricFamily(
            "localspec_engine_busy", "1 while the engine runs a request", value=float(p.busy())
        )
        yield CounterMetricFamily(
            "localspec_requests_cancelled",
            "Requests dropped or stopped early (client left, superseded, timed out)",
            value=p.cancelled(),
        )
        yield CounterMetricFamily(
            "localspec_engine_prompt_tokens",
            "Prompt tokens the engine evaluated, requests the client left included",
            value=p.prompt_evaluated(),
        )
        slots = list(p.slots())
        states = GaugeMetricFamily("localspec_slots", "Slots by state", labels=["state"])
        n_busy = sum(1 for s in slots if s.is_processing)
        states.add_metric(["processing"], n_busy)
        states.add_metric(["idle"], len(slots) - n_busy)
        yield states
        cached = GaugeMetricFamily(
            "localspec_slot_cached_tokens", "Tokens held in each slot's KV cache", labels=["slot"]
        )
        for s in slots:
            cached.add_metric([str(s.id)], len(s.tokens))
        yield cached
        memory = GaugeMetricFamily(
            "localspec_model_bytes",
            "Size of each loaded model's weights (its GGUF file)",
            labels=["model"],
        )
        for role, size in self._model_bytes().items():
            memory.add_metric([role], size)
        yield memory
        cpu = p.cpu()
        if cpu is not None:
            yield GaugeMetricFamily(
                "localspec_engine_threads",
                "Threads llama.cpp evaluations may use now: the cores other processes leave free",
                value=cpu[0],
            )
            yield GaugeMetricFamily(
                "localspec_cpu_other_busy_cores",
                "Cores other processes kept busy over the last load sample",
                value=cpu[1],
            )
        kv = p.kv()
        if kv is not None:
            yield GaugeMetricFamily(
                "localspec_kv_holes",
                "Cells freed below kept ones in the KV buffer (each costs evaluated tokens "
                "a dot product without flash attention, until a compaction)",
                value=kv[0],
            )
            yield CounterMetricFamily(
                "localspec_kv_compactions", "KV buffer compactions done by prefills", value=kv[1]
            )
        cache = p.host_cache()
        if cache is not None:
            yield from _host_cache_metrics(cache)
        yield from _restore_metrics(p.restores(), cache)
        ratio = GaugeMetricFamily(
            "localspec_draft_acceptance_ratio",
            "Accepted / drafted tokens since start, by draft source",
            labels=["source"],
        )
        for source, (drafted, accepted) in sorted(self.metrics.draft_totals.items()):
            if drafted:
                ratio.add_metric([source], accepted / drafted)
        yield ratio


def _host_cache_metrics(cache: HostCache) -> Iterable[Metric]:
    """The host cache's size and what it saved (engine/hostcache.py)."""
    gauges = (
        ("bytes", "Bytes of slot contexts held in host memory", cache.n_bytes),
        ("limit_bytes", "The host cache's bound (cache.ram_gb)", cache.max_bytes),
        ("entries", "Slot contexts held in host memory", len(cache)),
    )
    for name, doc, value in gauges:
        yield GaugeMetricFamily(f"localspec_host_cache_{name}", doc, value=value)
    counters = (
        ("restores", "Contexts restored from host memory instead of evaluated", cache.hits),
        ("restored_tokens", "Tokens of the contexts restored", cache.restored_tokens),
        ("restore_seconds", "Time spent restoring contexts", cache.restore_ms / 1e3),
        ("misses", "Prompts no cached context served better than their slot", cache.misses),
        (
            "stashes",
            "Contexts copied to host memory before a request overwrote them",
            cache.stashed,
        ),
        (
            "evictions",
            "Contexts dropped to stay within the bound (least recently used)",
            cache.evicted,
        ),
    )
    for name, doc, value in counters:
        yield CounterMetricFamily(f"localspec_host_cache_{name}", doc, value=value)


def _restore_metrics(
    restores: Mapping[str, RestoreTotal], cache: HostCache | None
) -> Iterable[Metric]:
    """Every way a slot's context came back without being evaluated, by source: the host
    cache (its own counters above, repeated under this label), a slot file, a restart."""
    totals = dict(restores)
    if cache is not None:
        totals["host_cache"] = RestoreTotal(
            cache.hits, cache.restored_tokens, cache.restore_ms / 1e3
        )
    families: tuple[tuple[str, str, Callable[[RestoreTotal], float]], ...] = (
        ("restores", "Slot contexts restored instead of evaluated", lambda t: t.contexts),
        ("restored_tokens", "Tokens of the slot contexts restored", lambda t: t.tokens),
        ("restore_seconds", "Time spent restoring slot contexts", lambda t: t.seconds),
    )
    for name, doc, value in families:
        family = CounterMetricFamily(
            f"localspec_context_{name}", f"{doc}, by source", labels=["source"]
        )
        for source, total in sorted(totals.items()):
            family.add_metric([source], value(total))
        yield family


class Metrics:
    def __init__(self, probes: Probes, *, process: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.draft_totals: dict[str, tuple[int, int]] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.http_requests = Counter(
            "localspec_http_requests",
            "HTTP requests answered, by route and status (401, 413, 503 included)",
            ["route", "status"],
            registry=r,
        )
        self.http_latency = Histogram(
            "localspec_http_request_seconds",
            "Wall time of every HTTP request, first byte to last",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "localspec_requests",
            "Completion requests answered",
            ["endpoint", "outcome"],
            registry=r,
        )

        def hist(name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, ["endpoint"], buckets=buckets, registry=r)

        self.latency = hist("localspec_request_seconds", "Total wall time of completion requests")
        self.queue_time = hist("localspec_queue_seconds", "Time a request waited for the engine")
        self.prompt_time = hist(
            "localspec_prompt_seconds", "Prompt processing time (cache reuse and evaluation)"
        )
        self.generation_time = hist(
            "localspec_generation_seconds", "Token generation time (drafting and verifying)"
        )
        self.tokens_per_second = hist(
            "localspec_generation_tokens_per_second",
            "Generated tokens per second, per completion",
            _RATE_BUCKETS,
        )
        self.prompt_per_second = hist(
            "localspec_prompt_tokens_per_second",
            "Prompt tokens evaluated per second, per completion",
            _RATE_BUCKETS,
        )
        self.overhead = Histogram(
            "localspec_server_overhead_seconds",
            "Time a request spent in the server outside the engine (HTTP, JSON, queue, prompt)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.prompt_evaluated = Counter(
            "localspec_prompt_tokens_evaluated", "Prompt tokens the target evaluated", registry=r
        )
        self.prompt_cached = Counter(
            "localspec_prompt_tokens_cached",
            "Prompt tokens reused from a slot's cache instead of evaluated",
            registry=r,
        )
        self.approximate = Counter(
            "localspec_answers_on_shifted_kv",
            "Answers whose prompt KV holds tokens moved by a KV shift (a cold cache could differ)",
            registry=r,
        )
        self.predicted = Counter("localspec_tokens_predicted", "Tokens generated", registry=r)
        self.budget_answers = Counter(
            "localspec_budget_answers",
            "Answers made from the cursor's nearest lines within t_max_prompt_ms "
            "(cache.jump_policy budget)",
            ["endpoint"],
            registry=r,
        )
        self.drafted = Counter(
            "localspec_draft_tokens", "Tokens proposed by a drafter", ["source"], registry=r
        )
        self.accepted = Counter(
            "localspec_draft_tokens_accepted",
            "Drafted tokens the target accepted",
            ["source"],
            registry=r,
        )
        r.register(_StateCollector(probes, self))
        if process:  # RSS, CPU time, open files of this process (Linux /proc only)
            ProcessCollector(registry=r)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: prometheus_client's ``labels`` takes a lock
        and checks and joins the values on every call (≈10 calls a request). The label sets
        are few (routes, statuses, endpoints, draft sources)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self.child(self.http_requests, route, str(status)).inc()
        self.child(self.http_latency, route).observe(seconds)

    def record(
        self, result: GenerationResult, endpoint: str = "completion", *, prompt: bool = True
    ) -> None:
        """One completion's figures. ``prompt=False`` for a request's extra completions: they
        share the first one's prompt evaluation, which is counted once."""
        child = self.child
        if prompt:
            self.prompt_evaluated.inc(result.n_evaluated)
            self.prompt_cached.inc(result.n_cached)
            child(self.prompt_time, endpoint).observe(result.prompt_ms / 1e3)
            if result.n_evaluated and result.prompt_ms > 0:
                rate = result.n_evaluated / result.prompt_ms * 1e3
                child(self.prompt_per_second, endpoint).observe(rate)
        if result.n_approx and result.tokens:
            self.approximate.inc()
        n_predicted = len(result.tokens)
        self.predicted.inc(n_predicted)
        child(self.generation_time, endpoint).observe(result.predicted_ms / 1e3)
        if n_predicted and result.predicted_ms > 0:
            rate = n_predicted / result.predicted_ms * 1e3
            child(self.tokens_per_second, endpoint).observe(rate)
        for source, stats in result.drafted.items():
            child(self.drafted, source).inc(stats.drafted)
            child(self.accepted, source).inc(stats.accepted)
            drafted, accepted = self.draft_totals.get(source, (0, 0))
            self.draft_totals[source] = (drafted + stats.drafted, accepted + stats.accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

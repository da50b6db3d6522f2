"""Prometheus metrics for the daemon, in a registry of its own (one per app, none global)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from localspec.engine.types import GenerationResult

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _FunctionCounter(Collector):
    """A counter whose value lives elsewhere (the worker counts; the thread never blocks)."""

    def __init__(self, name: str, doc: str, value: Callable[[], int]) -> None:
        self.name, self.doc, self.value = name, doc, value

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.doc, value=self.value())]


class Metrics:
    def __init__(
        self,
        *,
        queued: Callable[[], int],
        busy: Callable[[], bool],
        cancelled: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "localspec_requests",
            "Completion requests answered",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "localspec_request_seconds",
            "Wall time of completion requests",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
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
            "localspec_prompt_tokens_cached", "Prompt tokens reused from a slot's cache", registry=r
        )
        self.predicted = Counter("localspec_tokens_predicted", "Tokens generated", registry=r)
        self.drafted = Counter(
            "localspec_draft_tokens", "Tokens proposed by a drafter", ["source"], registry=r
        )
        self.accepted = Counter(
            "localspec_draft_tokens_accepted",
            "Drafted tokens the target accepted",
            ["source"],
            registry=r,
        )
        queue_depth = Gauge("localspec_queue_depth", "Requests waiting for the engine", registry=r)
        queue_depth.set_function(lambda: float(queued()))
        busy_gauge = Gauge("localspec_engine_busy", "1 while the engine runs a request", registry=r)
        busy_gauge.set_function(lambda: float(busy()))
        r.register(_FunctionCounter(
            "localspec_requests_cancelled",
            "Requests dropped or stopped early (client left, superseded, timed out)",
            cancelled,
        ))  # fmt: skip

    def record(self, result: GenerationResult) -> None:
        self.prompt_evaluated.inc(result.n_evaluated)
        self.prompt_cached.inc(result.n_cached)
        self.predicted.inc(len(result.tokens))
        for source, stats in result.drafted.items():
            self.drafted.labels(source).inc(stats.drafted)
            self.accepted.labels(source).inc(stats.accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

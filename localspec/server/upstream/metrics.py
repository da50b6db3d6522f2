"""Prometheus metrics of the upstream: who answered, why the local model did, how long the
upstream took to start answering, and its state (read at scrape time)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from localspec.server.upstream.config import UpstreamSettings
from localspec.server.upstream.health import UpstreamState

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
STATUSES = ("unknown", "up", "loading", "down", "refused")


class _State(Collector):
    def __init__(self, cfg: UpstreamSettings, state: Callable[[], UpstreamState]) -> None:
        self.cfg = cfg
        self.state = state

    def collect(self) -> Iterable[Metric]:
        now = self.state()
        up = GaugeMetricFamily(
            "localspec_upstream_up", "1 while the upstream answers requests", value=now.answers
        )
        yield up
        info = GaugeMetricFamily(
            "localspec_upstream_status",
            "The upstream's state (1 for the current one)",
            labels=["kind", "url", "status"],
        )
        for status in STATUSES:
            info.add_metric([self.cfg.kind, self.cfg.url, status], float(now.status == status))
        yield info


class BackendMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        cfg: UpstreamSettings,
        state: Callable[[], UpstreamState],
    ) -> None:
        self.answers = Counter(
            "localspec_backend_answers",
            "Answers by who computed them (upstream or local) and route",
            ["backend", "route"],
            registry=registry,
        )
        self.unanswered = Counter(
            "localspec_backend_errors",
            "Generation and other relayed requests answered with an error: the upstream's own "
            "4xx/5xx passed on (backend upstream), or nobody could answer (backend none: a 503 "
            "or 501 saying why), by HTTP status",
            ["backend", "route", "status"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "localspec_backend_fallbacks",
            "Completions the local model answered instead of the upstream, by reason",
            ["reason"],
            registry=registry,
        )
        self.failures = Counter(
            "localspec_upstream_failures",
            "Upstream requests that failed, by reason, before their answer began (the local "
            "model answered, or a 503) or during its stream (the editor got an error event)",
            ["reason", "phase"],
            registry=registry,
        )
        self.upstream_seconds = Histogram(
            "localspec_upstream_seconds",
            "Time from sending a request upstream to its answer starting: the first chunk of "
            "a stream; a non-streamed answer's whole body (servers send it when done)",
            ["route"],
            buckets=_BUCKETS,
            registry=registry,
        )
        registry.register(_State(cfg, state))

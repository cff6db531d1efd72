"""Prometheus metrics of a serving engine, named as vLLM's (`decodegraph:` prefix).

Each `EngineMetrics` owns a private `CollectorRegistry`, so several servers in one process
(tests) do not collide. Gauges and counters that the engine already keeps (`get_stats()`)
are read from the latest stats snapshot at scrape time; latency histograms are observed
by the engine thread as outputs come out of `step()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's, from sub-millisecond CPU steps to slow first tokens under load.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
_E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
)


class _StatsCollector(Collector):
    """Turns the latest `EngineStats` snapshot into gauges and counters at scrape time."""

    def __init__(self, get_stats: Callable[[], Any], model_name: str) -> None:
        self._get_stats = get_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:
            return
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"decodegraph:{name}", doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"decodegraph:{name}", doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0 to 1).",
            stats.kv_cache_usage,
        )
        yield counter("prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        runs = CounterMetricFamily(
            "decodegraph:graph_runs",
            "Forward steps per runtime graph mode (NONE, PIECEWISE, FULL).",
            labels=["model_name", "mode"],
        )
        for mode, count in sorted(dict(stats.graph_runs).items()):
            runs.add_metric([self._model_name, str(mode)], float(count))
        yield runs


class EngineMetrics:
    """The metrics of one served model; `render()` is the body of GET /metrics."""

    def __init__(self, model_name: str, get_stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "decodegraph:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "decodegraph:inter_token_latency_seconds",
            "Time between two outputs of a request (one per engine step that produced tokens).",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            "decodegraph:e2e_request_latency_seconds",
            "Time from arrival to the request's last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.registry.register(_StatsCollector(get_stats, model_name))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

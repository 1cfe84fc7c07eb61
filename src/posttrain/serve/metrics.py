"""The server's Prometheus metrics, in a registry of their own (two apps in one process never clash):
token counters, latency histograms, queue/running/KV gauges, tool-call outcomes and HTTP statuses,
each labelled by model and mode where that applies; and the JSON access-log line. Measures nothing
itself: the app reports to it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from posttrain.serve.chat import TOOL_OUTCOMES

access_log = logging.getLogger("posttrain.serve.access")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

ENDPOINTS = ("/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/models", "/health", "/metrics")


class ServeMetrics:
    """Every metric `posttrain serve` exports (names below; `docs/grafana-posttrain.json` charts them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        mm = ["model", "mode"]
        self.prompt_tokens = Counter(
            "posttrain_serve_prompt_tokens", "Prompt tokens prefilled (rendered template)", mm, registry=r
        )
        self.generation_tokens = Counter(
            "posttrain_serve_generation_tokens", "Tokens generated (usage.completion_tokens)", mm, registry=r
        )
        self.requests = Counter(
            "posttrain_serve_requests", "Generation requests finished, by finish", [*mm, "finish"], registry=r
        )
        self.ttft = Histogram(
            "posttrain_serve_time_to_first_token_seconds",
            "Arrival to first generated token (queue included)",
            mm,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "posttrain_serve_inter_token_latency_seconds",
            "Gap between successive tokens of one completion",
            mm,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "posttrain_serve_e2e_latency_seconds",
            "Arrival to last token",
            mm,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "posttrain_serve_queue_time_seconds",
            "Time waiting for a running slot",
            mm,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_length = Gauge(
            "posttrain_serve_queue_length", "Requests waiting for a running slot", mm, registry=r
        )
        self.running = Gauge("posttrain_serve_running_requests", "Requests in the engine", mm, registry=r)
        self.kv_usage = Gauge(
            "posttrain_serve_kv_cache_usage_ratio",
            "KV blocks allocated / KV blocks in the pool",
            mm,
            registry=r,
        )
        self.tool_calls = Counter(
            "posttrain_serve_tool_calls",
            f"Replies to requests with tools, by outcome ({', '.join(TOOL_OUTCOMES)})",
            [*mm, "outcome"],
            registry=r,
        )
        self.http = Counter(
            "posttrain_serve_http_responses",
            "HTTP responses by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.speculation = SpeculationCollector()
        r.register(self.speculation)

    def add_model(
        self,
        model: str,
        mode: str,
        kv_usage: Callable[[], float],
        speculation: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """Create a model's series at zero (so dashboards show them before traffic), its KV gauge and,
        for an engine that speculates, its draft counters (`speculation()` -> the engine's counts)."""
        for c in (self.prompt_tokens, self.generation_tokens):
            c.labels(model, mode)
        for outcome in TOOL_OUTCOMES:
            self.tool_calls.labels(model, mode, outcome)
        for g in (self.queue_length, self.running):
            g.labels(model, mode).set(0)
        for h in (self.ttft, self.itl, self.e2e, self.queue_time):
            h.labels(model, mode)
        self.kv_usage.labels(model, mode).set_function(kv_usage)
        if speculation is not None:
            self.speculation.sources.append((model, mode, speculation))

    def http_response(self, path: str, status: int) -> None:
        self.http.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpeculationCollector:
    """Draft tokens proposed and accepted per model, read from the engines at scrape time (the engine
    counts them; a Prometheus counter cannot be set), and their ratio since the server started."""

    def __init__(self) -> None:
        self.sources: list[tuple[str, str, Callable[[], dict[str, int]]]] = []

    def describe(self) -> list[Any]:
        return list(self._families({}))

    def collect(self) -> list[Any]:
        counts = {}
        for model, mode, read in self.sources:
            try:
                counts[(model, mode)] = read()
            except Exception:  # a scrape must never fail because an engine is mid-reload
                continue
        return list(self._families(counts))

    @staticmethod
    def _families(counts: dict[tuple[str, str], dict[str, int]]) -> tuple[Any, ...]:
        mm = ["model", "mode"]
        drafted = CounterMetricFamily(
            "posttrain_serve_spec_draft_tokens", "Speculative draft tokens verified", labels=mm
        )
        accepted = CounterMetricFamily(
            "posttrain_serve_spec_accepted_tokens", "Speculative draft tokens accepted", labels=mm
        )
        ratio = GaugeMetricFamily(
            "posttrain_serve_spec_acceptance_ratio",
            "Accepted / verified draft tokens since the server started",
            labels=mm,
        )
        for (model, mode), c in counts.items():
            d, a = c.get("draft_tokens", 0), c.get("accepted_tokens", 0)
            drafted.add_metric([model, mode], d)
            accepted.add_metric([model, mode], a)
            ratio.add_metric([model, mode], a / d if d else 0.0)
        return drafted, accepted, ratio


def kv_usage_of(engine: Any) -> Callable[[], float]:
    def usage() -> float:
        try:
            stats = engine.kv_stats()
        except Exception:  # a scrape must never fail because an engine is mid-reload
            return 0.0
        total = stats.get("blocks_total") or 0
        return float(stats.get("blocks_allocated", 0)) / total if total else 0.0

    return usage


def log_access(record: dict[str, Any]) -> None:
    """One JSON line per request on the `posttrain.serve.access` logger."""
    access_log.info(json.dumps(record, separators=(",", ":"), default=str))

"""Prometheus metrics of one service instance (own registry, so several apps can live in one process).

Under `serve` with several workers (PROMETHEUS_MULTIPROC_DIR set by the supervisor for every worker), each worker
writes its values to files there and /metrics, whichever worker answers it, reports the sum over the workers
(prometheus_client's multiprocess mode): counters and histograms add up, the gauges of current counts (in-flight
requests, open connections, queue depth) are the sum over live workers, `latentlm_models_loaded` the most any
worker serves, and a gauge of another module (e.g. the heavy lane's) one series per worker (label `pid`). The
current counts of the other workers are at most `LIVE_REFRESH_S` old."""

from __future__ import annotations

import asyncio
import logging
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKENS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
log = logging.getLogger("latentlm.service")

LIVE_REFRESH_S = 1.0  # how often a worker publishes its current counts (`Metrics.refresh`) under several workers


def multiprocess_dir() -> str | None:
    """The directory of the workers' metric files when this process is one of several workers."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    """Request duration, queue wait/depth, in-flight requests, open connections, batch sizes, tokens, errors,
    cache hits/misses."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.request_duration = Histogram("latentlm_request_duration_seconds", "HTTP request duration",
                                          ["route", "method", "status"], buckets=LATENCY, registry=r)
        self.queue_wait = Histogram("latentlm_queue_wait_seconds", "time a request waited for its batch",
                                    ["operation"], buckets=LATENCY, registry=r)
        self.queue_depth = Gauge("latentlm_queue_depth", "requests waiting for the inference thread", registry=r,
                                 multiprocess_mode="livesum")
        self.batch_requests = Histogram("latentlm_batch_requests", "requests merged into one batch",
                                        ["operation"], buckets=SIZES, registry=r)
        self.batch_sequences = Histogram("latentlm_batch_sequences", "sequences in one batch",
                                         ["operation"], buckets=SIZES, registry=r)
        self.batch_tokens = Histogram("latentlm_batch_tokens", "tokens in one batch", ["operation"],
                                      buckets=TOKENS, registry=r)
        self.batch_seconds = Histogram("latentlm_batch_seconds", "inference time of one batch", ["operation"],
                                       buckets=LATENCY, registry=r)
        self.tokens = Counter("latentlm_tokens_processed", "tokens processed", ["model", "operation"], registry=r)
        self.errors = Counter("latentlm_errors", "error responses", ["status", "type"], registry=r)
        self.cache_hits = Counter("latentlm_cache_hits", "response cache hits", ["operation"], registry=r)
        self.cache_misses = Counter("latentlm_cache_misses", "response cache misses", ["operation"], registry=r)
        self.cache_errors = Counter("latentlm_cache_errors", "cache reads/writes that failed", registry=r)
        self.cache_skipped = Counter("latentlm_cache_skipped", "cache reads/writes skipped while the cache "
                                     "circuit breaker is open", registry=r)
        self.cache_breaker_trips = Counter("latentlm_cache_breaker_trips", "times the cache circuit breaker "
                                           "opened", registry=r)
        self.rate_limit_errors = Counter("latentlm_rate_limit_errors", "rate-limit checks skipped because "
                                         "Redis failed (the request was let through)", registry=r)
        self.models_loaded = Gauge("latentlm_models_loaded", "models currently served", registry=r,
                                   multiprocess_mode="livemax")
        # read when scraped: `middleware.Guard` and `server.Server` point them at their counts (0 until then)
        self.inflight = Gauge("latentlm_inflight_requests", "HTTP requests inside the app now (over "
                              "LATENTLM_MAX_INFLIGHT, /v1 requests are answered 503 overloaded at once)", registry=r,
                              multiprocess_mode="livesum")
        self.connections = Gauge("latentlm_open_connections", "client connections the server holds open now (over "
                                 "LATENTLM_MAX_CONNECTIONS, requests are answered 503 overloaded at once)", registry=r,
                                 multiprocess_mode="livesum")
        self._durations: dict[tuple[str, str, int], Histogram] = {}

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        """request_duration.labels(route, method, status).observe(seconds), with the child looked up once."""
        key = (route, method, status)
        child = self._durations.get(key)
        if child is None:
            child = self._durations[key] = self.request_duration.labels(route, method, str(status))
        child.observe(seconds)

    def error(self, status: int, kind: str) -> None:
        self.errors.labels(str(status), kind).inc()

    def refresh(self) -> None:
        """Under several workers: write this worker's current value of every gauge read by a function at scrape
        time (`Gauge.set_function`: in-flight requests, open connections, queue depth, ...) to its metric file,
        where the other workers' /metrics read it (they cannot call this process's functions). A no-op otherwise.
        """
        if multiprocess_dir() is None:
            return
        for collector in list(self.registry._collector_to_names):  # the registry's own list of its metrics
            if isinstance(collector, Gauge) and not collector._labelnames:
                for sample in collector._child_samples():  # the function's value for a set_function gauge
                    collector.set(sample.value)

    def render(self) -> bytes:
        """The exposition text: this instance's registry, or under several workers the sum over them."""
        if multiprocess_dir() is None:
            return generate_latest(self.registry)
        self.refresh()
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        return generate_latest(merged)


async def publish_live_metrics(metrics: Metrics) -> None:
    """One of several workers: publish this worker's current counts every LIVE_REFRESH_S (`Metrics.refresh`)."""
    while True:
        await asyncio.sleep(LIVE_REFRESH_S)
        try:
            metrics.refresh()
        except Exception as e:  # a metric file that cannot be written must not stop the worker
            log.warning("cannot publish this worker's metrics: %s", e)

"""`serve`'s Prometheus metrics (runner/app/serve.py counts the requests, runner/app/serve_engine.py the batches)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (two servers in one process do not mix)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "runner_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "runner_request_seconds",
            "time to answer a request, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("runner_generated_tokens", "tokens generated", registry=r)
        self.queue = Gauge("runner_queue_depth", "requests waiting for the engine", registry=r)
        self.batch = Histogram(
            "runner_batch_occupancy",
            "requests in the running batch as each one joins it (itself counted)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)

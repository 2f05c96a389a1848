"""Prometheus metrics of a serving engine, with vLLM's metric names under our prefix. The engine
thread records them (prometheus_client's metrics are thread-safe); the server exposes the
registry at /metrics."""
from __future__ import annotations

PREFIX = "distengine:"
# Seconds: from a millisecond to minutes (vLLM's buckets, roughly).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)


class EngineMetrics:
    def __init__(self, model_name: str, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = registry if registry is not None else CollectorRegistry()
        names, labels, reg = ["model_name"], {"model_name": model_name}, self.registry

        def gauge(name: str, text: str):
            return Gauge(PREFIX + name, text, names, registry=reg).labels(**labels)

        def counter(name: str, text: str):  # exposed as NAME_total
            return Counter(PREFIX + name, text, names, registry=reg).labels(**labels)

        def histogram(name: str, text: str):
            return Histogram(PREFIX + name, text, names, buckets=LATENCY_BUCKETS, registry=reg).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0 to 1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from a request's arrival to its end.")
        self._seen = (0, 0, 0)  # prefix queries, prefix hits, preemptions already counted

    def record_state(self, scheduler) -> None:
        """Gauges and the scheduler's cumulative counts, after a step (engine thread)."""
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(scheduler.manager.usage)
        stats = scheduler.manager.prefix_cache_stats
        now = (stats.queries, stats.hits, scheduler.num_preemptions)
        for metric, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions), now, self._seen):
            if new > old:
                metric.inc(new - old)
        self._seen = now

    def text(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)

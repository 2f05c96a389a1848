"""Prometheus metrics of a serving engine, with vLLM's metric names and labels under our prefix,
and each again under vLLM's own prefix (`vllm:`), so that vLLM's dashboards and alerts read them
unchanged. `AsyncLLM` records them from each step's outputs and the scheduler's figures
(prometheus_client's metrics are thread-safe); the server exposes the registry at /metrics.
`StatsLogger` writes vLLM's periodic log line from the same counts."""
from __future__ import annotations

import logging

from distengine.scheduler import SchedulerStats

PREFIX = "distengine:"
VLLM_PREFIX = "vllm:"
# vLLM's finish reasons, each a label of `request_success` from the start (a dashboard sees 0, not nothing).
FINISH_REASONS = ("stop", "length", "abort", "error")
# Seconds: from a millisecond to minutes (vLLM's buckets, roughly).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)


class EngineMetrics:
    def __init__(self, model_name: str, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = registry if registry is not None else CollectorRegistry()
        names, labels, reg = ["model_name"], {"model_name": model_name}, self.registry
        self._ours: list = []  # every metric, for their `vllm:` copies
        reg.register(_Renamed(self._ours, PREFIX, VLLM_PREFIX))

        def mine(metric):
            self._ours.append(metric)
            return metric

        def gauge(name: str, text: str):
            return mine(Gauge(PREFIX + name, text, names, registry=reg)).labels(**labels)

        def counter(name: str, text: str):  # exposed as NAME_total
            return mine(Counter(PREFIX + name, text, names, registry=reg)).labels(**labels)

        def histogram(name: str, text: str):
            metric = Histogram(PREFIX + name, text, names, buckets=LATENCY_BUCKETS, registry=reg)
            return mine(metric).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0 to 1).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted at each request's first token).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from a request's arrival to its end.")
        success = mine(Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                               names + ["finished_reason"], registry=reg))
        self.request_success = {r: success.labels(finished_reason=r, **labels) for r in FINISH_REASONS}
        self._seen = (0, 0, 0)  # prefix queries, prefix hits, preemptions already counted
        self.prompt_total = 0      # the counters' values, for the log line
        self.generation_total = 0

    def record_cache_config(self, num_gpu_blocks: int, block_size: int) -> None:
        """vLLM's `cache_config_info`: the pool's size as labels of a gauge set to 1 (with the usage
        gauge, what tells the blocks in use)."""
        from prometheus_client import Gauge
        info = Gauge(PREFIX + "cache_config_info", "The KV cache's configuration.", ["num_gpu_blocks", "block_size"],
                     registry=self.registry)
        info.labels(num_gpu_blocks=str(num_gpu_blocks), block_size=str(block_size)).set(1)
        self._ours.append(info)

    def count_finished(self, reason: str) -> None:
        counter = self.request_success.get(reason)
        if counter is not None:
            counter.inc()

    def count_prompt(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.prompt_total += tokens

    def count_generated(self, tokens: int = 1) -> None:
        self.generation_tokens.inc(tokens)
        self.generation_total += tokens

    def totals(self) -> tuple[int, int, int, int]:
        """Prompt tokens prefilled, tokens generated, prefix-cache queries and hits, so far."""
        return self.prompt_total, self.generation_total, self._seen[0], self._seen[1]

    def record_state(self, stats: SchedulerStats) -> None:
        """Gauges and the scheduler's cumulative counts, after a step."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.preemptions)
        for metric, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions), now, self._seen):
            if new > old:
                metric.inc(new - old)
        self._seen = now

    def text(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


class _Renamed:
    """A collector that shows `metrics` again with `old` prefix replaced by `new`, built from
    their values at each scrape: one metric to update, two names to read."""

    def __init__(self, metrics: list, old: str, new: str) -> None:
        self.metrics, self.old, self.new = metrics, old, new

    def _name(self, name: str) -> str:
        return self.new + name[len(self.old):]

    def collect(self):
        from prometheus_client.metrics_core import Metric
        for metric in list(self.metrics):
            for family in metric.collect():
                copy = Metric(self._name(family.name), family.documentation, family.type, family.unit)
                copy.samples = [s._replace(name=self._name(s.name)) for s in family.samples]
                yield copy


class StatsLogger:
    """vLLM's periodic log line: every `interval` seconds in which the engine had work, the
    prompt and generation throughput over the interval, the requests running and waiting, the KV
    cache's usage and the prefix cache's hit rate over the interval."""

    def __init__(self, interval: float, logger: logging.Logger | None = None) -> None:
        if not interval > 0:
            raise ValueError(f"the stats log interval must be > 0 seconds, got {interval}")
        self.interval = interval
        self.logger = logger or logging.getLogger("distengine.stats")
        self._last: tuple[float, tuple[int, int, int, int]] | None = None

    def tick(self, now: float, metrics: EngineMetrics, stats: SchedulerStats) -> None:
        totals = metrics.totals()
        if self._last is None:
            self._last = (now, totals)
            return
        then, before = self._last
        if now - then < self.interval:
            return
        self._last = (now, totals)
        prompt, generated, queries, hits = (a - b for a, b in zip(totals, before))
        running, waiting = stats.running, stats.waiting
        if not (prompt or generated or running or waiting):
            return  # idle: nothing to report
        dt = now - then
        self.logger.info(f"avg prompt throughput: {prompt / dt:.1f} tokens/s, avg generation throughput: "
                         f"{generated / dt:.1f} tokens/s, running: {running} reqs, waiting: {waiting} reqs, "
                         f"KV cache usage: {100 * stats.kv_usage:.1f}%, prefix cache hit rate: "
                         f"{100 * hits / queries if queries else 0.0:.1f}%")

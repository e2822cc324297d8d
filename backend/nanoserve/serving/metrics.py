"""Prometheus metrics through Triton's custom metrics API (pb_utils.MetricFamily), labelled {model, version}.

Create a Metrics in initialize() (MetricFamily exists only there) and make every later call from ONE thread:
tritonserver 2.51 crashes when custom metrics are updated from several threads at once.

Every metric update is an IPC round trip to tritonserver during which the stub holds the GIL, so the engine
thread stalls for it. Updates are therefore recorded here and sent by publish() (the response thread calls
it every PUBLISH_INTERVAL and whenever the last request in flight ends), off the path of the responses: one
call per counter and changed gauge per interval instead of several per engine step. Histogram samples have no
batched form: one call each, at publish.

finalize() must close() the Metrics: python_backend deletes a collected family through IPC to tritonserver, and a
family still alive when the stub tears the model down is collected after that IPC is gone (the stub segfaults).
"""
from __future__ import annotations

FINISH_REASONS = ("stop", "length", "abort")
# Seconds and token counts; Triton adds the +Inf bucket.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0]
LENGTH_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
PUBLISH_INTERVAL = 0.5  # seconds between publishes while requests run; Prometheus scrapes every few seconds


class Metrics:
    def __init__(self, pb_utils, model: str, version: str):
        self._families = []  # a family (and its metrics) disappears from /metrics when garbage-collected
        self._labels = {"model": model, "version": version}
        family = pb_utils.MetricFamily
        gauge, counter, histogram = family.GAUGE, family.COUNTER, family.HISTOGRAM
        self._family_cls = family
        self.running = self._metric(gauge, "nanoserve_requests_running", "Requests in the running batch")
        self.waiting = self._metric(gauge, "nanoserve_requests_waiting", "Requests waiting to be scheduled")
        self.kv_used = self._metric(gauge, "nanoserve_kv_blocks_used", "KV cache blocks in use")
        self.kv_total = self._metric(gauge, "nanoserve_kv_blocks_total", "KV cache blocks in the pool")
        self.hit_rate = self._metric(gauge, "nanoserve_prefix_cache_hit_rate",
                                     "Prompt tokens taken from the prefix cache / prompt tokens scheduled")
        self.prompt_tokens = self._metric(counter, "nanoserve_prompt_tokens_total", "Prompt tokens of started requests")
        self.generation_tokens = self._metric(counter, "nanoserve_generation_tokens_total", "Generated tokens")
        self.preemptions = self._metric(counter, "nanoserve_preemptions_total", "Sequences preempted (recompute)")
        finished = self._family(counter, "nanoserve_requests_finished_total", "Finished requests by reason")
        self.finished = {r: finished.Metric(labels={**self._labels, "reason": r}) for r in FINISH_REASONS}
        self.ttft = self._metric(histogram, "nanoserve_time_to_first_token_seconds", "Time to first token",
                                 TTFT_BUCKETS)
        self.itl = self._metric(histogram, "nanoserve_inter_token_latency_seconds",
                                "Mean time between output tokens, one sample per finished request", ITL_BUCKETS)
        self.e2e = self._metric(histogram, "nanoserve_e2e_request_latency_seconds", "Request latency, arrival to "
                                "last token", E2E_BUCKETS)
        self.prompt_length = self._metric(histogram, "nanoserve_prompt_length_tokens", "Prompt length of finished "
                                          "requests", LENGTH_BUCKETS)
        self.generation_length = self._metric(histogram, "nanoserve_generation_length_tokens", "Output length of "
                                              "finished requests", LENGTH_BUCKETS)
        self._increments: dict = {}  # counter -> increment not published yet
        self._gauges: dict = {}  # gauge -> latest value not published yet
        self._samples: list = []  # (histogram, value) not published yet
        self._published_gauges: dict = {}
        self._last_preemptions = 0

    def _family(self, kind, name: str, description: str):
        family = self._family_cls(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    def _metric(self, kind, name: str, description: str, buckets=None):
        family = self._family(kind, name, description)
        if buckets is None:
            return family.Metric(labels=self._labels)
        return family.Metric(labels=self._labels, buckets=buckets)

    # ---- updates (one thread) -----------------------------------------------------------------------
    def record_engine(self, stats: dict) -> None:
        """Gauges and the preemption counter from engine.stats()."""
        hits, computed = stats["prefix_cache_hit_tokens"], stats["prompt_tokens_computed"]
        self._gauges.update({self.running: stats["num_running"], self.waiting: stats["num_waiting"],
                             self.kv_used: stats["num_total_blocks"] - stats["num_free_blocks"],
                             self.kv_total: stats["num_total_blocks"],
                             self.hit_rate: hits / (hits + computed) if hits + computed else 0.0})
        self._count(self.preemptions, stats["num_preemptions"] - self._last_preemptions)
        self._last_preemptions = stats["num_preemptions"]

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self._samples.append((self.ttft, ttft))
        self._count(self.prompt_tokens, num_prompt_tokens)

    def record_inter_token(self, seconds: float) -> None:
        self._samples.append((self.itl, seconds))

    def record_generated(self, num_tokens: int) -> None:
        self._count(self.generation_tokens, num_tokens)

    def record_finished(self, reason: str, e2e: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        if reason in self.finished:
            self._count(self.finished[reason], 1)
        self._samples += [(self.e2e, e2e), (self.prompt_length, num_prompt_tokens),
                          (self.generation_length, num_output_tokens)]

    def _count(self, counter, increment) -> None:
        if increment > 0:
            self._increments[counter] = self._increments.get(counter, 0) + increment

    @property
    def unpublished(self) -> bool:
        return bool(self._increments or self._gauges or self._samples)

    def publish(self) -> None:
        """Send what was recorded since the last publish: each counter's increment, each changed gauge, each
        histogram sample."""
        increments, self._increments = self._increments, {}
        for counter, increment in increments.items():
            counter.increment(increment)
        gauges, self._gauges = self._gauges, {}
        for gauge, value in gauges.items():
            if self._published_gauges.get(gauge) != value:
                gauge.set(value)
                self._published_gauges[gauge] = value
        samples, self._samples = self._samples, []
        for histogram, value in samples:
            histogram.observe(value)

    def close(self) -> None:
        """Drop every family and metric now, in finalize(), while the stub can still tell tritonserver. Nothing
        may be recorded or published afterwards."""
        vars(self).clear()

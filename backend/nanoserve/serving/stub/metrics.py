"""Prometheus metrics through Triton's custom metrics API (pb_utils.MetricFamily): nanoserve's own (labelled
{model, version}) and, with `vllm_names`, the same quantities under vLLM's names (vllm:*, labelled {model_name,
model, version}: vLLM's label and vllm_backend's), so that dashboards and routers built for vLLM work unchanged.

Create a Metrics in initialize() (MetricFamily exists only there) and make every later call from ONE thread:
tritonserver 2.51 crashes when custom metrics are updated from several threads at once.

Every metric update is an IPC round trip to tritonserver during which the stub holds the GIL, so the engine
thread stalls for it. Updates are therefore recorded here and sent by publish() (the response thread calls
it every PUBLISH_INTERVAL and whenever the last request in flight ends), off the path of the responses: one
call per counter and changed gauge per interval instead of several per engine step. Histogram samples have no
batched form: one call each, at publish; with vLLM's per-token samples these are many, so the response thread
publishes them a slice at a time between its other work (SAMPLES_PER_ROUND).

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
# vLLM's default buckets (vllm/v1/metrics/buckets.py, vLLM 0.32) for the vllm:* histograms.
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0]
VLLM_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]  # vllm:request_params_n (vLLM's and vllm_backend's)
PUBLISH_INTERVAL = 0.5  # seconds between publishes while requests run; Prometheus scrapes every few seconds
SAMPLES_PER_ROUND = 256  # histogram samples per publish (a few ms of IPC), then the response thread sends again

# (quantity, kind, name, description[, buckets]): each family shows one quantity the response thread records.
NANOSERVE_FAMILIES = [
    ("running", "gauge", "nanoserve_requests_running", "Requests in the running batch"),
    ("waiting", "gauge", "nanoserve_requests_waiting", "Requests waiting to be scheduled"),
    ("kv_blocks_used", "gauge", "nanoserve_kv_blocks_used", "KV cache blocks in use"),
    ("kv_blocks_total", "gauge", "nanoserve_kv_blocks_total", "KV cache blocks in the pool"),
    ("hit_rate", "gauge", "nanoserve_prefix_cache_hit_rate",
     "Prompt tokens taken from the prefix cache / prompt tokens scheduled"),
    ("prompt_tokens", "counter", "nanoserve_prompt_tokens_total", "Prompt tokens of started requests"),
    ("generation_tokens", "counter", "nanoserve_generation_tokens_total", "Generated tokens"),
    ("preemptions", "counter", "nanoserve_preemptions_total", "Sequences preempted (recompute)"),
    ("ttft", "histogram", "nanoserve_time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS),
    ("mean_token_gap", "histogram", "nanoserve_inter_token_latency_seconds",
     "Mean time between output tokens, one sample per finished request", ITL_BUCKETS),
    ("e2e", "histogram", "nanoserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
     E2E_BUCKETS),
    ("prompt_length", "histogram", "nanoserve_prompt_length_tokens", "Prompt length of finished requests",
     LENGTH_BUCKETS),
    ("generation_length", "histogram", "nanoserve_generation_length_tokens", "Output length of finished requests",
     LENGTH_BUCKETS),
]


def vllm_families(max_model_len: int) -> list[tuple]:
    """vLLM's names for the same quantities (its counters' exposed names, with _total), plus the per-token gaps."""
    lengths = buckets_1_2_5(max_model_len)
    return [
        ("running", "gauge", "vllm:num_requests_running", "Requests in the running batch"),
        ("waiting", "gauge", "vllm:num_requests_waiting", "Requests waiting to be scheduled"),
        ("kv_usage", "gauge", "vllm:kv_cache_usage_perc", "Share of the KV cache blocks in use (1 = all)"),
        ("prompt_tokens", "counter", "vllm:prompt_tokens_total", "Prompt tokens of started requests"),
        ("generation_tokens", "counter", "vllm:generation_tokens_total", "Generated tokens"),
        ("preemptions", "counter", "vllm:num_preemptions_total", "Sequences preempted (recompute)"),
        ("prefix_queries", "counter", "vllm:prefix_cache_queries_total",
         "Prompt tokens looked up in the prefix cache"),
        ("prefix_hits", "counter", "vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache"),
        ("ttft", "histogram", "vllm:time_to_first_token_seconds", "Time to first token", VLLM_TTFT_BUCKETS),
        ("token_gap", "histogram", "vllm:inter_token_latency_seconds", "Time between two output tokens",
         VLLM_ITL_BUCKETS),
        ("token_gap", "histogram", "vllm:time_per_output_token_seconds",
         "Time between two output tokens (vllm_backend's name)", VLLM_ITL_BUCKETS),
        ("e2e", "histogram", "vllm:e2e_request_latency_seconds", "Request latency, arrival to last token",
         VLLM_E2E_BUCKETS),
        ("prompt_length", "histogram", "vllm:request_prompt_tokens", "Prompt length of finished requests", lengths),
        ("generation_length", "histogram", "vllm:request_generation_tokens", "Output length of finished requests",
         lengths),
        ("params_n", "histogram", "vllm:request_params_n", "The n request parameter of finished requests",
         VLLM_N_BUCKETS),
        ("params_max_tokens", "histogram", "vllm:request_params_max_tokens",
         "The max_tokens request parameter of finished requests (its default where not given)", lengths),
    ]


# speculative decoding: (quantity, engine.stats() key, name, description); the names get _total, and per position
# (label "position") for the accepted tokens per position
SPEC_DECODE_COUNTERS = [
    ("spec_drafts", "spec_decode_num_drafts", "spec_decode_num_drafts", "Drafts verified (a request's proposals "
                                                                         "in one step)"),
    ("spec_draft_tokens", "spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Proposed tokens verified"),
    ("spec_accepted", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Proposed tokens accepted"),
]
SPEC_PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by position in the draft")


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class Metrics:
    def __init__(self, pb_utils, model: str, version: str, vllm_names: bool = False, max_model_len: int = 8192,
                 num_speculative_tokens: int = 0):
        self._families = []  # a family (and its metrics) disappears from /metrics when garbage-collected
        self._family_cls = pb_utils.MetricFamily
        self._targets: dict[str, list] = {}  # quantity -> the metrics that show it
        labels = {"model": model, "version": version}
        self._add(NANOSERVE_FAMILIES, labels)
        finished = self._family("counter", "nanoserve_requests_finished_total", "Finished requests by reason")
        self.finished = {r: finished.Metric(labels={**labels, "reason": r}) for r in FINISH_REASONS}
        if vllm_names:
            self._add(vllm_families(max_model_len), {"model_name": model, **labels})
        if num_speculative_tokens:
            self._add_spec_decode("nanoserve_", labels, num_speculative_tokens)
            if vllm_names:
                self._add_spec_decode("vllm:", {"model_name": model, **labels}, num_speculative_tokens)
        self._increments: dict = {}  # counter -> increment not published yet
        self._gauges: dict = {}  # gauge -> latest value not published yet
        self._samples: list = []  # (histogram, value) not published yet
        self._published_gauges: dict = {}
        self._engine_totals: dict[str, int] = {}  # quantity -> the engine's running total at the last record
        self.max_model_len = max_model_len

    def _family(self, kind: str, name: str, description: str):
        kinds = {"gauge": self._family_cls.GAUGE, "counter": self._family_cls.COUNTER,
                 "histogram": self._family_cls.HISTOGRAM}
        family = self._family_cls(name=name, description=description, kind=kinds[kind])
        self._families.append(family)
        return family

    def _add(self, table: list[tuple], labels: dict) -> None:
        for quantity, kind, name, description, *buckets in table:
            family = self._family(kind, name, description)
            metric = family.Metric(labels=labels, buckets=buckets[0]) if buckets else family.Metric(labels=labels)
            self._targets.setdefault(quantity, []).append(metric)

    def _add_spec_decode(self, prefix: str, labels: dict, num_positions: int) -> None:
        self._add([(quantity, "counter", f"{prefix}{name}_total", description)
                   for quantity, _, name, description in SPEC_DECODE_COUNTERS], labels)
        name, description = SPEC_PER_POSITION
        family = self._family("counter", f"{prefix}{name}_total", description)
        for position in range(num_positions):
            metric = family.Metric(labels={**labels, "position": str(position)})
            self._targets.setdefault(f"spec_accepted_{position}", []).append(metric)

    # ---- updates (one thread) -----------------------------------------------------------------------
    def record_engine(self, stats: dict) -> None:
        """Gauges and the engine's own counters from engine.stats()."""
        hits, computed = stats["prefix_cache_hit_tokens"], stats["prompt_tokens_computed"]
        total, used = stats["num_total_blocks"], stats["num_total_blocks"] - stats["num_free_blocks"]
        gauges = {"running": stats["num_running"], "waiting": stats["num_waiting"], "kv_blocks_used": used,
                  "kv_blocks_total": total, "kv_usage": used / total if total else 0.0,
                  "hit_rate": hits / (hits + computed) if hits + computed else 0.0}
        for quantity, value in gauges.items():
            for gauge in self._targets.get(quantity, ()):
                self._gauges[gauge] = value
        totals = {"preemptions": stats["num_preemptions"], "prefix_hits": hits, "prefix_queries": hits + computed}
        if "spec_decode_num_drafts" in stats:
            totals.update({quantity: stats[key] for quantity, key, _, _ in SPEC_DECODE_COUNTERS})
            per_position = stats["spec_decode_num_accepted_tokens_per_pos"]
            totals.update({f"spec_accepted_{position}": n for position, n in enumerate(per_position)})
        for quantity, value in totals.items():
            self._count(quantity, value - self._engine_totals.get(quantity, 0))
            self._engine_totals[quantity] = max(value, self._engine_totals.get(quantity, 0))

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self._observe("ttft", ttft)
        self._count("prompt_tokens", num_prompt_tokens)

    def record_token_gaps(self, gaps: list[float]) -> None:
        """Per request of a step, the time between its output token and its previous one (vLLM's inter-token
        latency): one call per step, not per token."""
        self._observe("token_gap", *gaps)

    def record_inter_token(self, seconds: float) -> None:
        """A finished request's mean time between output tokens."""
        self._observe("mean_token_gap", seconds)

    def record_generated(self, num_tokens: int) -> None:
        self._count("generation_tokens", num_tokens)

    def record_finished(self, reason: str, e2e: float, num_prompt_tokens: int, num_output_tokens: int,
                        params=None) -> None:
        """A finished request; params: its SamplingParams (n and max_tokens for vLLM's histograms)."""
        if reason in self.finished:
            self._increments[self.finished[reason]] = self._increments.get(self.finished[reason], 0) + 1
        self._observe("e2e", e2e)
        self._observe("prompt_length", num_prompt_tokens)
        self._observe("generation_length", num_output_tokens)
        if params is not None:
            self._observe("params_n", params.n)
            self._observe("params_max_tokens", params.max_tokens_for(num_prompt_tokens, self.max_model_len))

    def _count(self, quantity: str, increment) -> None:
        if increment > 0:
            for counter in self._targets.get(quantity, ()):
                self._increments[counter] = self._increments.get(counter, 0) + increment

    def _observe(self, quantity: str, *values) -> None:
        self._samples += [(histogram, value) for histogram in self._targets.get(quantity, ()) for value in values]

    @property
    def unpublished(self) -> bool:
        return bool(self._increments or self._gauges or self._samples)

    def publish(self, max_samples: int | None = None) -> None:
        """Send what was recorded since the last publish: each counter's increment, each changed gauge, and
        histogram samples, the oldest max_samples of them (None: all; the rest stay unpublished)."""
        increments, self._increments = self._increments, {}
        for counter, increment in increments.items():
            counter.increment(increment)
        gauges, self._gauges = self._gauges, {}
        for gauge, value in gauges.items():
            if self._published_gauges.get(gauge) != value:
                gauge.set(value)
                self._published_gauges[gauge] = value
        cut = len(self._samples) if max_samples is None else max_samples
        samples, self._samples = self._samples[:cut], self._samples[cut:]
        for histogram, value in samples:
            histogram.observe(value)

    def close(self) -> None:
        """Drop every family and metric now, in finalize(), while the stub can still tell tritonserver. Nothing
        may be recorded or published afterwards."""
        vars(self).clear()

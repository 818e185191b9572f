"""Prometheus metrics of ``GET /metrics``, under vLLM's names with ``folio:`` for ``vllm:``.

Latencies and token counts are observed by the gateway itself as text deltas arrive
(``GatewayService.handle_text_batch``); running/waiting requests and KV usage are asked from the
scheduler's and kvmanager's admin sockets at scrape time (``GatewayService.refresh_engine_stats``)
and keep their last value when a service does not answer in time. With ``--enable-lora``, vLLM's
``lora_requests_info`` and per-adapter running/waiting requests (the scheduler's) and adapter
loads and evictions (the executor's). Own registry: no process
collectors of whoever imports us, and tests can build several gateways in one process.

The inter-token latency is observed for every streamed token, so it keeps its own bucket counts
(``TokenHistogram``: a list index and two additions per delta, no lock) and is exported as a
histogram at scrape time; the per-request histograms use prometheus_client's ``Histogram``.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from folio.services.gateway.mailbox import ChoiceTiming
from folio.shared.messages import TextDelta

# vLLM's buckets, so dashboards built for it read ours
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TokenHistogram:
    """A histogram of one label value that takes a value with a count (``observe(gap, n)``: ``n``
    tokens that each waited ``gap``), collected by the registry as a ``HistogramMetricFamily``:
    the same ``_bucket``/``_count``/``_sum``/``_created`` series as prometheus_client's
    ``Histogram`` (``le`` is inclusive). Not thread-safe: the gateway's event loop alone observes
    and scrapes it."""

    def __init__(self, name: str, documentation: str, label: tuple[str, str], buckets: list[float],
                 registry: CollectorRegistry):
        self.name, self.documentation, self.label = name, documentation, label
        self._bounds = [*buckets, float("inf")]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect_left(self._bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self._counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(``le``, observations at most ``le``) per bucket, ``+Inf`` last."""
        out, total = [], 0
        for bound, num in zip(self._bounds, self._counts):
            total += num
            out.append((floatToGoString(bound), total))
        return out

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=[self.label[0]])

    def describe(self) -> list[HistogramMetricFamily]:
        return [self._family()]

    def collect(self) -> list[HistogramMetricFamily]:
        family = self._family()
        family.add_metric([self.label[1]], self.cumulative(), self.sum)
        if prometheus_metrics._use_created:  # PROMETHEUS_DISABLE_CREATED_SERIES, as for its Histogram
            family.add_sample(f"{self.name}_created", {self.label[0]: self.label[1]}, self._created)
        return [family]


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def one(kind, name: str, doc: str, **kwargs):  # a metric of one series: this model's
            return kind(name, doc, labels, registry=r, **kwargs).labels(model_name)

        def counter(name: str, doc: str):
            return one(Counter, name, doc)

        def gauge(name: str, doc: str):
            return one(Gauge, name, doc)

        def histogram(name: str, doc: str, buckets):
            return one(Histogram, name, doc, buckets=buckets)

        # The prefix-cache counters and the preemptions are read from the kvmanager's and the
        # scheduler's cumulative stats at scrape time (a counter grows by the difference). Speculative
        # decoding has vLLM's spec_decode names (per position: drafts accepted at position i). Structured
        # output: the executor's compiles, cache and constrained work; the tokenizer's 400s.
        self.ttft = histogram("folio:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = TokenHistogram("folio:inter_token_latency_seconds", "Time between output tokens.",
                                  ("model_name", model_name), ITL_BUCKETS, r)
        self.e2e = histogram("folio:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue_time = histogram("folio:request_queue_time_seconds", "Arrival to the first step.", E2E_BUCKETS)
        self.running = gauge("folio:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("folio:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("folio:kv_cache_usage_perc", "KV cache usage (1 = all blocks in use).")
        self.kv_blocks_used = gauge("folio:kv_cache_blocks_used", "KV blocks in use.")
        self.kv_blocks_total = gauge("folio:kv_cache_blocks_total", "KV blocks in the pool.")
        self.prefix_cache_queries = counter("folio:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_cache_hits = counter("folio:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.kv_blocks_cached = gauge("folio:kv_cache_blocks_cached", "Free KV blocks kept for prefix reuse.")
        self.prompt_tokens = counter("folio:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("folio:generation_tokens", "Generation tokens produced.")
        self.swapped = gauge("folio:num_requests_swapped", "Requests swapped out to the host tier.")
        self.preemptions = counter("folio:num_preemptions", "Preemptions (recompute or swap).")
        self.spec_drafts = counter("folio:spec_decode_num_drafts", "Verifications of at least one draft.")
        self.spec_draft_tokens = counter("folio:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("folio:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter("folio:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position.", labels + ["position"], registry=r)
        self.grammar_compiles = counter("folio:grammar_compiles", "Grammars compiled (one per new spec).")
        self.grammar_compile_seconds = counter("folio:grammar_compile_seconds", "Time spent compiling grammars.")
        self.grammar_cache_hits = counter("folio:grammar_cache_hits", "Requests whose grammar was compiled already.")
        self.grammar_errors = counter("folio:grammar_errors", "Specs that could not be compiled (400s).")
        self.constrained_steps = counter("folio:constrained_steps", "Steps with at least one constrained row.")
        self.constrained_rows = counter("folio:constrained_rows", "Tokens sampled under a grammar.")
        # LoRA adapters (--enable-lora): vLLM's lora_requests_info (one sample, its value the time it
        # was set, labelled with the adapters running and waiting), per-adapter queues, the
        # executor's loads into device slots and evictions from them
        self.lora_info = Gauge("folio:lora_requests_info", "Running and waiting LoRA adapters (value: when set).",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self.lora_running = Gauge("folio:lora_num_requests_running", "Requests running, per LoRA adapter.",
                                  labels + ["lora_name"], registry=r)
        self.lora_waiting = Gauge("folio:lora_num_requests_waiting", "Requests waiting, per LoRA adapter.",
                                  labels + ["lora_name"], registry=r)
        # images in: the executor's vision tower (each image encoded once per request, in its first chunk)
        self.images_encoded = counter("folio:images_encoded", "Images the vision tower encoded.")
        self.image_tokens = counter("folio:image_tokens", "Image placeholder tokens the vision tower filled.")
        self.encoder_seconds = counter("folio:encoder_seconds", "Time in the vision tower and projector.")
        self.lora_loads = counter("folio:lora_loads", "LoRA adapters copied into a device slot.")
        self.lora_evictions = counter("folio:lora_evictions", "LoRA adapters evicted from a device slot.")
        self._last_totals: dict[str | tuple, float] = {}  # each cumulative stat's value at the last scrape
        self._success = Counter("folio:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._model_name = model_name

    def on_batch(self, num_tokens: int) -> None:
        """A batch of deltas brought ``num_tokens`` new tokens: counted once per batch, not per delta."""
        self.generation_tokens.inc(num_tokens)

    def on_delta(self, timing: ChoiceTiming, delta: TextDelta, now: float) -> None:
        """One choice's delta arrived at monotonic time ``now`` (its tokens count in ``on_batch``)."""
        num_new = len(delta.token_ids)
        if num_new:
            if timing.first_token is None:
                timing.first_token = now
                self.ttft.observe(now - timing.arrival)
            elif timing.last_token is not None:
                # several tokens in one delta (a merged or speculative step) share the gap
                self.itl.observe((now - timing.last_token) / num_new, num_new)
            timing.last_token = now
        if delta.queue_time_s is not None:
            self.queue_time.observe(delta.queue_time_s)
        if delta.finish_reason is not None and delta.error is None:
            self.e2e.observe(now - timing.arrival)
            self.prompt_tokens.inc(delta.num_prompt_tokens)
            self._success.labels(self._model_name, delta.finish_reason).inc()

    def set_grammar_stats(self, tokenizer: dict | None, executor: dict | None) -> None:
        if tokenizer:
            self._advance(self.grammar_errors, "grammar_errors", tokenizer.get("num_grammar_errors", 0))
        if executor:
            self._advance(self.grammar_compiles, "grammar_compiles", executor.get("num_grammar_compiles", 0))
            self._advance(self.grammar_compile_seconds, "grammar_seconds",
                          executor.get("grammar_compile_seconds_total", 0.0))
            self._advance(self.grammar_cache_hits, "grammar_hits", executor.get("num_grammar_cache_hits", 0))
            self._advance(self.constrained_steps, "constrained_steps", executor.get("num_constrained_steps", 0))
            self._advance(self.constrained_rows, "constrained_rows", executor.get("num_constrained_rows", 0))

    def set_image_stats(self, executor: dict | None) -> None:
        """Images in: what the executor's vision tower encoded, and its time."""
        if executor:
            self._advance(self.images_encoded, "images", executor.get("num_images_encoded", 0))
            self._advance(self.image_tokens, "image_tokens", executor.get("num_image_tokens_encoded", 0))
            self._advance(self.encoder_seconds, "encoder_seconds", executor.get("encoder_seconds_total", 0.0))

    def set_lora_stats(self, scheduler: dict | None, executor: dict | None) -> None:
        if scheduler and "lora_running" in scheduler:
            running, waiting = scheduler["lora_running"] or {}, scheduler.get("lora_waiting") or {}
            self.lora_info.clear()
            self.lora_info.labels(str(scheduler.get("max_loras") or ""), ",".join(sorted(waiting)),
                                  ",".join(sorted(running))).set(time.time())
            for gauge, counts in ((self.lora_running, running), (self.lora_waiting, waiting)):
                gauge.clear()
                for name, num in counts.items():
                    gauge.labels(self._model_name, name).set(num)
        if executor:
            self._advance(self.lora_loads, "lora_loads", executor.get("lora_loads", 0))
            self._advance(self.lora_evictions, "lora_evictions", executor.get("lora_evictions", 0))

    def set_engine_stats(self, scheduler: dict | None, kvmanager: dict | None) -> None:
        if scheduler:
            self.running.set(scheduler.get("num_running", 0))
            self.waiting.set(scheduler.get("num_waiting", 0))
            self.swapped.set(scheduler.get("num_swapped", 0))
            self._advance(self.preemptions, "preemptions", scheduler.get("num_preemptions", 0))
            self._advance(self.spec_drafts, "spec_drafts", scheduler.get("num_spec_drafts", 0))
            self._advance(self.spec_draft_tokens, "spec_draft_tokens", scheduler.get("num_spec_draft_tokens", 0))
            self._advance(self.spec_accepted_tokens, "spec_accepted", scheduler.get("num_spec_accepted_tokens", 0))
            for pos, num in enumerate(scheduler.get("spec_accepted_per_pos") or []):
                self._advance(self.spec_accepted_per_pos.labels(self._model_name, str(pos)), ("spec_pos", pos), num)
        if kvmanager:
            total = kvmanager.get("num_blocks_total", 0) or 0
            used = kvmanager.get("num_blocks_used", 0) or 0
            self.kv_blocks_total.set(total)
            self.kv_blocks_used.set(used)
            self.kv_usage.set(used / total if total else 0.0)
            self.kv_blocks_cached.set(kvmanager.get("num_blocks_cached", 0) or 0)
            self._advance(self.prefix_cache_queries, "prefix_queries", kvmanager.get("num_prefix_cache_queries", 0))
            self._advance(self.prefix_cache_hits, "prefix_hits", kvmanager.get("num_prefix_cache_hits", 0))

    def _advance(self, counter, key, total) -> None:
        """A service's cumulative ``total`` (read at scrape time) becomes the counter's increment
        since the last scrape; a total that went down means the service restarted and counts afresh."""
        total = total or 0
        last = self._last_totals.get(key, 0)
        if total < last:
            last = 0
        counter.inc(total - last)
        self._last_totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)

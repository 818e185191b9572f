"""The gateway's latency metrics: the inter-token histogram keeps its own bucket counts
(``TokenHistogram``) and must read exactly like prometheus_client's ``Histogram`` fed the same
values one by one; ``GatewayMetrics.on_delta`` turns deltas into TTFT and inter-token samples."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from folio.services.gateway.mailbox import ChoiceTiming
from folio.services.gateway.metrics import ITL_BUCKETS, GatewayMetrics, TokenHistogram
from folio.shared.messages import TextDelta

NAME, DOC = "folio:inter_token_latency_seconds", "Time between output tokens."


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """``name{labels}`` -> value of every exposed line but the creation time."""
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_token_histogram_reads_like_a_prometheus_histogram():
    reference_registry, registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(NAME, DOC, ["model_name"], buckets=ITL_BUCKETS, registry=reference_registry).labels("m")
    hist = TokenHistogram(NAME, DOC, ("model_name", "m"), ITL_BUCKETS, registry)
    # bounds themselves (le is inclusive), just above them, zero, past the last bound, repeats
    for value, count in [(0.01, 2), (0.0100001, 1), (0.0, 1), (0.015, 3), (0.3, 5), (80.0, 1), (81.0, 3), (1e6, 1)]:
        for _ in range(count):
            reference.observe(value)
        hist.observe(value, count)
    expected, got = _samples(reference_registry), _samples(registry)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert got[f'{NAME}_count{{model_name="m"}}'] == 17 == hist.count
    assert got[f'{NAME}_bucket{{le="0.01",model_name="m"}}'] == 3
    assert got[f'{NAME}_bucket{{le="80.0",model_name="m"}}'] == 13
    assert "_created" in generate_latest(registry).decode()


def test_deltas_give_one_ttft_then_one_gap_per_token():
    metrics = GatewayMetrics("m")
    timing = ChoiceTiming(arrival=10.0)  # times in binary fractions: exact gaps, exact bucket edges
    metrics.on_delta(timing, TextDelta(req_id="a", text="x", token_ids=[1], queue_time_s=0.5), 10.25)
    metrics.on_delta(timing, TextDelta(req_id="a", text="", token_ids=[2]), 10.28125)  # half a character
    metrics.on_delta(timing, TextDelta(req_id="a", text="yz", token_ids=[3, 4, 5, 6]), 10.53125)  # merged steps
    metrics.on_delta(timing, TextDelta(req_id="a", finish_reason="length", num_prompt_tokens=7), 10.75)
    got = _samples(metrics.registry)
    label = '{model_name="m"}'
    assert got[f"folio:time_to_first_token_seconds_count{label}"] == 1
    assert got[f"folio:time_to_first_token_seconds_sum{label}"] == pytest.approx(0.25)
    assert got[f"{NAME}_count{label}"] == 5  # one gap per token after the first
    assert got[f"{NAME}_sum{label}"] == 0.28125
    assert got[f'{NAME}_bucket{{le="0.025",model_name="m"}}'] == 0
    assert got[f'{NAME}_bucket{{le="0.05",model_name="m"}}'] == 1  # 0.03125 s before token 2
    assert got[f'{NAME}_bucket{{le="0.075",model_name="m"}}'] == 5  # 0.25 s shared by 4 tokens
    assert got[f"folio:e2e_request_latency_seconds_count{label}"] == 1
    assert got[f"folio:request_queue_time_seconds_sum{label}"] == pytest.approx(0.5)
    assert got[f"folio:prompt_tokens_total{label}"] == 7

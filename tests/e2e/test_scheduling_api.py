"""Parallel sampling, best_of, beam search, priority and drain through the served API
(``folio serve`` on SmolLM2-135M-Instruct, the official ``openai`` client)."""

from __future__ import annotations

import urllib.request

import openai
import pytest
import torch

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def test_n_choices_share_the_prompt_through_forks(client, server):
    before_sched = server.admin("scheduler", "stats")
    before_kv = server.admin("kvmanager", "stats")
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=4,
                                    seed=11)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    after_sched = server.admin("scheduler", "stats")
    assert after_sched["num_forks"] - before_sched["num_forks"] == 3
    # 4 prompt tokens: the forks share its first 3 tokens' block, each choice copies it on its first write
    after_kv = server.admin("kvmanager", "stats")
    assert after_kv["num_cow_copies"] - before_kv["num_cow_copies"] == 3
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 32


def test_best_of_returns_the_choices_with_the_highest_cumulative_logprob(client):
    args = dict(model=MODEL, prompt="My favourite fruit is", max_tokens=6, temperature=1.0, seed=3)
    every = client.completions.create(**args, n=3, logprobs=0)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**args, n=1, best_of=3)
    assert [c.text for c in best.choices] == [ranked[0].text]
    assert best.choices[0].logprobs is None  # asked for none: used for the ranking only
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all three were generated
    two = client.completions.create(**args, n=2, best_of=3, logprobs=1)
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]] and two.choices[1].index == 1


@pytest.fixture
def dense_client(smollm_dir):
    """A server of the dense fp32 weights (``--quantization none``), as transformers computes: the
    default server's int4 layers (bf16 activations) round otherwise, and a beam search keeps
    whichever of two near-equal candidates its last bits favour (on one CPU the int4 server's
    third beam matched transformers', on another it did not)."""
    from folio.testing.server import start_server, stop_server

    srv = start_server(smollm_dir, "--num-kv-blocks", "512", "--max-num-batched-tokens", "512",
                       "--quantization", "none")
    yield openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    stop_server(srv)


def test_beam_search_over_http_equals_transformers(dense_client, smollm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    client = dense_client

    from tests.core.scheduler.test_beam_engine import hf_beam_search

    prompt = "The best way to learn a language is"
    body = dict(use_beam_search=True, length_penalty=1.0, early_stopping=True)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=3, extra_body=body)
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig()
    beams = hf_beam_search(model, tok.encode(prompt), 3, 3, 1.0, True, 12, tok.eos_token_id)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [tok.decode(b, skip_special_tokens=True)
                                                                           for b in beams]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=3, stream=True,
                                       extra_body=body)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in sorted(out.choices, key=lambda c: c.index)]


@pytest.mark.parametrize("bad", [
    {"n": 2, "best_of": 1},
    {"n": 1, "best_of": 2, "stream": True},
    {"use_beam_search": True, "temperature": 0.7},
    {"use_beam_search": True, "stop": ["."]},
    {"n": 200},
])
def test_bad_scheduling_parameters_are_400(client, bad):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=bad)
    assert err.value.response.json()["error"]["type"] == "invalid_request_error"


def test_priority_is_accepted(client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": -3})
    assert out.usage.completion_tokens >= 1


def test_drain_refuses_new_requests_with_503_until_resumed(client, server):
    assert server.admin("scheduler", "drain")["draining"] is True
    try:
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and "draining" in err.value.response.json()["error"]["message"]
    finally:
        assert server.admin("scheduler", "resume") == {"draining": False}
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_scheduling_metrics(client, server):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    for name in ("folio:num_preemptions_total", "folio:num_requests_swapped", "folio:request_queue_time_seconds_count"):
        assert name in text, name
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("folio:request_queue_time_seconds_count"))
    assert count >= 1

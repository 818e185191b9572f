"""Speculative decoding served: ``folio serve --speculative-config '{"method": "suffix"}'`` (suffix
speculation, drafting chosen per step) gives the same greedy text as the plain server, drafts a
repeated request from the earlier one's answer, and reports acceptance in ``folio scheduler
stats`` and ``/metrics``; the eagle3 head shipped for SmolLM2 serves the same greedy text too."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from folio.testing.server import start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Repeat after me: red green blue, red green blue, red green blue.",
    "Copy this address: 221B Baker Street, London, NW1 6XE, United Kingdom.",
    "Name three colors of the rainbow.",
    "Why do cats purr? Answer in two sentences.",
]


@pytest.fixture(scope="module")
def spec_server(smollm_dir):
    srv = start_server(smollm_dir, "--num-kv-blocks", "512", "--speculative-config",
                       '{"method": "suffix", "num_speculative_tokens": 8}')
    yield srv
    stop_server(srv)


def test_suffix_speculation_serves_the_same_greedy_text(client, spec_server):
    fast = openai.OpenAI(base_url=spec_server.base_url, api_key="unused", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        got = fast.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens
        streamed = fast.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == want.choices[0].message.content
    executor = spec_server.admin("executor", "stats")
    # the streamed repeat of each prompt drafted from the first answer, kept in the shared trie
    assert executor["suffix_drafts_from_trie"] > 0 and executor["suffix_cached_requests"] >= len(PROMPTS)
    assert executor["spec_steps_speculated"] > 0
    stats = spec_server.admin("scheduler", "stats")
    assert stats["num_spec_accepted_tokens"] > 0 and stats["spec_accepted_per_pos"][0] > 0
    assert stats["spec_mean_accepted_length"] > 1.0
    with urllib.request.urlopen(spec_server.base_url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    accepted = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("folio:spec_decode_num_accepted_tokens_total"))
    assert accepted == stats["num_spec_accepted_tokens"]
    assert 'folio:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text


@pytest.fixture(scope="module")
def eagle_server(smollm_dir):
    # the head shipped for SmolLM2 ("model" left out), drafting every step
    srv = start_server(smollm_dir, "--num-kv-blocks", "512", "--speculative-config",
                       '{"method": "eagle3", "num_speculative_tokens": 3, "adaptive": false}')
    yield srv
    stop_server(srv)


def test_the_shipped_eagle3_head_serves_the_same_greedy_text(client, eagle_server):
    fast = openai.OpenAI(base_url=eagle_server.base_url, api_key="unused", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        got = fast.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
    assert eagle_server.admin("executor", "stats")["eagle_proposals"] > 0
    assert eagle_server.admin("scheduler", "stats")["num_spec_accepted_tokens"] > 0

"""The served system end to end: the official ``openai`` client against ``folio serve``."""

from __future__ import annotations

import json
import threading
import urllib.request

import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["auto", "none"])
def server(request, smollm_dir):
    """This file runs against the default server (int4: the packaged Q4_1 GGUF repacked) and
    against ``--quantization none`` (fp32); the other e2e files use the default one only."""
    from folio.testing.server import start_server, stop_server

    if request.param == "auto":
        yield request.getfixturevalue("default_server")
        return
    srv = start_server(smollm_dir, "--num-kv-blocks", "512", "--max-num-batched-tokens", "512",
                       "--quantization", request.param)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


def joined_stream(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].text if hasattr(c.choices[0], "text") else c.choices[0].delta.content or "")
                   for c in chunks if c.choices)
    return text, chunks


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/health") as r:
        assert r.status == 200


def test_completion_greedy_stream_equals_non_stream_and_reports_usage(client):
    args = dict(model=MODEL, prompt="The three primary colors are", max_tokens=24, temperature=0)
    full = client.completions.create(**args)
    assert full.object == "text_completion" and full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == 5 and full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    text, chunks = joined_stream(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert text == full.choices[0].text and len(text) > 0
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].choices == []


def test_chat_greedy_matches_the_in_process_runtime(client, server, smollm_dir):
    from transformers import AutoTokenizer

    from tests.executor.toy_driver import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.sampling import SamplingParams

    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    quantization = server.admin("executor", "stats")["quantization"]
    assert quantization in ("int4", "none")
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=16, quantization=quantization), smollm_dir)
    expected = generate(runner, [ids], SamplingParams(temperature=0, max_tokens=20), eos_token_id=tok.eos_token_id)[0]
    expected_text = tok.decode([t for t in expected if t != tok.eos_token_id], skip_special_tokens=True)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected_text
    assert reply.usage.prompt_tokens == len(ids)
    text, _ = joined_stream(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True))
    assert text == expected_text


def test_n_choices_with_a_seed_are_reproducible(client):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=7)
    first = client.completions.create(**args)
    second = client.completions.create(**args)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each choice samples on its own
    other = client.completions.create(**{**args, "seed": 8})
    assert [c.text for c in sorted(other.choices, key=lambda c: c.index)] != texts


def test_stop_string_ends_the_text_before_it(client):
    args = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=30, temperature=0)
    free = client.completions.create(**args).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), free
    cut = client.completions.create(**args, stop=[stop, "zzzz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]
    text, _ = joined_stream(client.completions.create(**args, stop=stop, stream=True))
    assert text == free[: free.index(stop)]


def test_logprobs_in_completions_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="Paris is the capital of", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(token_lp, abs=1e-4)  # greedy: the best one
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"n": 0},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"max_tokens": 9000},  # prompt + max_tokens beyond the 8192-token context
        {"logprobs": "many"},
    ],
)
def test_bad_input_is_a_400_with_an_openai_error(client, bad):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", **{"max_tokens": 4, **bad})
    body = err.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_malformed_json_400(client, server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    req = urllib.request.Request(server.base_url + "/completions", data=b'{"model": ', method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and "error" in json.loads(err.value.read())
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).usage.completion_tokens >= 1


def test_32_concurrent_streams_each_equal_their_solo_output(client, server):
    topics = ["rivers", "music", "bread", "stars", "trains", "bees", "chess", "rain"]
    jobs = [(f"Write one sentence about {topics[i % 8]} number {i}.", 6 + (i * 7) % 27) for i in range(32)]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text for p, n in jobs]
    results: list[str | None] = [None] * len(jobs)

    def run(i):
        p, n = jobs[i]
        results[i], _ = joined_stream(client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == solo
    server.wait_for(lambda: server.admin("kvmanager", "stats")["num_blocks_used"] == 0, what="blocks freed")


def test_a_client_gone_mid_stream_frees_its_blocks(client, server):
    stream = client.completions.create(model=MODEL, prompt="Tell me a very long story.", max_tokens=2000,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    assert server.admin("kvmanager", "stats")["num_blocks_used"] > 0
    stream.close()  # the connection drops
    server.wait_for(lambda: server.admin("kvmanager", "stats")["num_blocks_used"] == 0, timeout_s=10,
                    what="the aborted request's blocks")
    assert server.admin("scheduler", "stats")["num_running"] == 0


def test_metrics_after_traffic(client, server):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    for name in ("folio:time_to_first_token_seconds_count", "folio:e2e_request_latency_seconds_count",
                 "folio:inter_token_latency_seconds_count", "folio:num_requests_running",
                 "folio:num_requests_waiting", "folio:kv_cache_usage_perc", "folio:prompt_tokens_total",
                 "folio:generation_tokens_total"):
        assert name in text, name
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("folio:time_to_first_token_seconds_count"))
    assert count >= 1

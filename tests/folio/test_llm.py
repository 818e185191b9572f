"""The offline API (``folio.LLM``) against ``folio serve`` on the same tiny random model (SmolLM2's
tokenizer and chat template): the same greedy text, logprobs, seeded choices, beams, stop strings
and chat replies; prefix-cache hits in its stats and in the served usage; the chosen token among
each position's top logprobs (``echo`` with ``logprobs=0``); ``/tokenize`` of a chat equal to the
prompt the offline chat ran; ``--served-model-name``."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from folio import LLM, SamplingParams
from folio.testing.models import write_tiny_chat_model
from folio.testing.server import start_server, stop_server

NAME = "tiny"
ENGINE = {"dtype": "float32", "num_kv_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "Water boils at"]
CHAT = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What color is the sky?"}]
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about opening hours, "
          "bread, cakes and orders, politely and in short sentences, and you never invent prices. ") * 2


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-offline"), smollm_tokenizer_dir, max_position_embeddings=512)


@pytest.fixture(scope="module")
def server(model):
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    srv = start_server(model, "--served-model-name", NAME, *flags)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    # retries: on a loaded machine a service may miss its health pings for a moment, and the
    # gateway then answers 503 (as it should); the comparison is about what comes back after
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=5, timeout=120)


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, **ENGINE)


def post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.base_url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # a service missed its pings for a moment on a loaded machine


def test_generate_gives_the_served_completions(llm, client):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    outs = llm.generate(PROMPTS, params)
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, out in zip(PROMPTS, outs):
        served = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
        (choice,) = out.outputs
        assert choice.text == served.choices[0].text and len(choice.token_ids) == 12
        assert choice.finish_reason == served.choices[0].finish_reason == "length"
        assert served.usage.prompt_tokens == len(out.prompt_token_ids)
        lp = served.choices[0].logprobs
        assert [p[t].logprob for p, t in zip(choice.logprobs, choice.token_ids)] == pytest.approx(lp.token_logprobs,
                                                                                               abs=1e-4)
        for position, top in zip(choice.logprobs, lp.top_logprobs):
            assert {x.decoded_token for x in position.values()} == set(top)
        assert choice.cumulative_logprob == pytest.approx(sum(lp.token_logprobs), abs=1e-3)
    ids = outs[0].prompt_token_ids  # a prompt given as token ids runs the same
    (again,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids and again.prompt is None


def test_seeded_choices_beams_and_stop_strings_match_the_served_ones(llm, client):
    sampled = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=8))[0]
    served = client.completions.create(model=NAME, prompt=PROMPTS[1], n=3, temperature=0.9, seed=11, max_tokens=8)
    assert [c.text for c in sampled.outputs] == [c.text for c in sorted(served.choices, key=lambda c: c.index)]
    assert len({c.text for c in sampled.outputs}) > 1
    beams = llm.generate(PROMPTS[0], SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0,
                                                    max_tokens=6))[0]
    served = client.completions.create(model=NAME, prompt=PROMPTS[0], n=2, best_of=3, temperature=0, max_tokens=6,
                                       extra_body={"use_beam_search": True})
    assert [c.text for c in beams.outputs] == [c.text for c in sorted(served.choices, key=lambda c: c.index)]
    free = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0].outputs[0]
    served = client.completions.create(model=NAME, prompt=PROMPTS[2], temperature=0, max_tokens=16, stop=[stop])
    assert cut.text == served.choices[0].text == free[: free.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)


def test_chat_gives_the_served_reply_and_tokenize_the_same_prompt(llm, client, server):
    (out,) = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, logprobs=0))
    served = client.chat.completions.create(model=NAME, messages=CHAT, temperature=0, max_tokens=10, logprobs=True,
                                            top_logprobs=0)
    assert out.outputs[0].text == served.choices[0].message.content
    assert out.prompt.endswith("<|im_start|>assistant\n")
    content = served.choices[0].logprobs.content
    assert [p[t].logprob for p, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)] == pytest.approx(
        [c.logprob for c in content], abs=1e-4)
    # top_logprobs=0: each position still carries the chosen token, alone
    assert all([(t.token, t.logprob) for t in c.top_logprobs] == [(c.token, c.logprob)] for c in content)
    assert all(len(p) == 1 for p in out.outputs[0].logprobs)
    tokenized = post(server, "/tokenize", {"model": NAME, "messages": CHAT})
    assert tokenized["tokens"] == out.prompt_token_ids and tokenized["max_model_len"] == 512
    assert post(server, "/detokenize", {"model": NAME, "tokens": out.prompt_token_ids})["prompt"] == out.prompt
    assert [m.id for m in client.models.list().data] == [NAME]  # --served-model-name


def test_echo_with_logprobs_0_scores_every_prompt_token_as_offline(llm, client):
    """lm-eval's loglikelihood request shape."""
    served = client.completions.create(model=NAME, prompt=PROMPTS[1], echo=True, logprobs=0, max_tokens=1,
                                       temperature=0)
    lp = served.choices[0].logprobs
    assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None
    assert all(top == {token: value} for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                                   lp.top_logprobs[1:]))
    (out,) = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    scored = [None if p is None else p[t].logprob for p, t in zip(out.prompt_logprobs, out.prompt_token_ids)]
    assert scored[0] is None and len(scored) == len(lp.tokens) - 1
    assert scored[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-4)


def test_prefix_cache_hits_show_in_the_stats_as_in_the_served_usage(llm, client):
    before = llm.stats()
    first = llm.generate(SYSTEM + "When do you open?", SamplingParams(temperature=0, max_tokens=4))[0]
    second = llm.generate(SYSTEM + "Do you sell rye bread?", SamplingParams(temperature=0, max_tokens=4))[0]
    after = llm.stats()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 48
    assert after["num_cached_tokens_total"] - before["num_cached_tokens_total"] == second.num_cached_tokens
    assert after["prefix_cache_hit_rate"] > 0
    assert after["num_free_blocks"] == after["num_blocks_total"]  # everything went back
    client.completions.create(model=NAME, prompt=SYSTEM + "When do you open?", temperature=0, max_tokens=4)
    served = client.completions.create(model=NAME, prompt=SYSTEM + "Do you sell rye bread?", temperature=0,
                                       max_tokens=4)
    assert served.usage.prompt_tokens_details.cached_tokens == second.num_cached_tokens
    assert served.choices[0].text == second.outputs[0].text


def test_bad_input_raises_and_the_engine_goes_on(llm):
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm.generate(["fine", "too long " * 300], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="invalid messages"):
        llm.chat([{"role": "nobody", "content": "x"}])
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM("unused", no_such_flag=1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM("unused", tensor_parallel_size=2)
    (out,) = llm.generate("fine", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_blocks_total"]

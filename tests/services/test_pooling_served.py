"""Pooling through the real stack (``folio serve --task generate,embed``: five processes, ipc://
sockets, HTTP) on a tiny random Qwen3 with SmolLM2's tokenizer, against transformers on the same
weights in fp32: the official ``openai`` client's ``embeddings.create`` (floats, and base64 as
it asks by default), token-id inputs, ``dimensions``; ``/v1/rerank`` and ``/v1/score`` over plain
HTTP (p(yes) of the yes/no logits); chat streams that run while embeddings do give the tokens they
give alone; and bad inputs, each a 400 with an OpenAI error, the server answering after each."""

from __future__ import annotations

import base64
import json
import struct
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from folio.core.input_processor import RerankFormat
from folio.testing.models import write_tiny_qwen3_chat_model
from folio.testing.server import post_json, served
from tests.folio.test_pooling import DOCS, QUERY, TEXTS, cosine, reference_scores

pytestmark = pytest.mark.slow

FLAGS = ["--task", "generate,embed", "--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "16",
         "--max-num-batched-tokens", "64", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_qwen3_chat_model(tmp_path_factory.mktemp("tiny-pool-served"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def server(model):
    with served(model, *FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=3, timeout=120)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    return post_json(server.base_url + path, body)


def reference_embeddings(model_dir: str, ids: list[list[int]], dimensions: int | None = None) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for i in ids:
            last = model(torch.tensor([i])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(last[:dimensions], dim=0))
    return out


def test_embeddings_create_floats_and_base64_match_transformers(client, server, model):
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(model)(t)["input_ids"] for t in TEXTS]
    want = reference_embeddings(model, ids)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    assert floats.usage.prompt_tokens == sum(map(len, ids))
    for f, d, w in zip(floats.data, decoded.data, want):
        assert cosine(f.embedding, w) >= 0.9999
        assert d.embedding == pytest.approx(f.embedding, abs=1e-5)  # (a second run: prefix hits, other batches)
    status, raw = post(server, "/embeddings", {"input": TEXTS[1], "encoding_format": "base64"})
    data = base64.b64decode(raw["data"][0]["embedding"])
    assert status == 200 and list(struct.unpack(f"<{len(data) // 4}f", data)) == floats.data[1].embedding
    by_ids = client.embeddings.create(model="tiny", input=ids[:2], encoding_format="float")
    assert [cosine(e.embedding, w) >= 0.9999 for e, w in zip(by_ids.data, want)] == [True, True]
    one = client.embeddings.create(model="tiny", input=ids[2], encoding_format="float")  # a list of token ids
    assert len(one.data) == 1 and cosine(one.data[0].embedding, want[2]) >= 0.9999
    short = client.embeddings.create(model="tiny", input=TEXTS[:2], dimensions=16, encoding_format="float")
    for e, w in zip(short.data, reference_embeddings(model, ids[:2], 16)):
        assert len(e.embedding) == 16 and cosine(e.embedding, w) >= 0.9999


def test_rerank_and_score_match_transformers_yes_no_logits(server, model):
    want = reference_scores(model, RerankFormat(), QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    status, body = post(server, "/rerank", {"model": "tiny", "query": QUERY, "documents": DOCS, "top_n": 3})
    assert status == 200 and [r["index"] for r in body["results"]] == order[:3]
    for r in body["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) <= 1e-4 and r["document"]["text"] == DOCS[r["index"]]
    status, body = post(server, "/score", {"model": "tiny", "text_1": QUERY, "text_2": DOCS})
    assert status == 200 and [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert max(abs(d["score"] - w) for d, w in zip(body["data"], want)) <= 1e-4
    status, body = post(server, "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                            "return_documents": False})
    assert status == 200 and [r["index"] for r in body["results"]] == order
    assert all("document" not in r for r in body["results"])


def chat_tokens(client, prompt: str) -> str:
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=24, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_chat_streams_while_embeddings_run_give_the_tokens_they_give_alone(client):
    prompts = [f"Tell me about {w}" for w in ("ferries", "gulls", "harbours", "bread")]
    alone = [chat_tokens(client, p) for p in prompts]
    with ThreadPoolExecutor(12) as pool:
        embeds = [pool.submit(client.embeddings.create, model="tiny", input=TEXTS * 3, encoding_format="float")
                  for _ in range(8)]
        chats = [pool.submit(chat_tokens, client, p) for p in prompts]
        mixed = [c.result() for c in chats]
        assert all(len(e.result().data) == 3 * len(TEXTS) for e in embeds)
    assert mixed == alone and all(alone)


BAD = [
    ("/embeddings", {"input": [[5, 10**6]]}, "outside the vocabulary"),
    ("/embeddings", {"input": [list(range(1, 600))]}, "maximum context length"),
    ("/embeddings", {"input": " ".join(["gulls"] * 700)}, "maximum context length"),
    ("/embeddings", {"input": "x", "dimensions": 65}, "at most the model's 64"),
    ("/embeddings", {"input": ""}, "input"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/chat/completions", {"model": "tiny", "messages": []}, "messages"),
]


def test_bad_inputs_are_400s_and_the_server_keeps_serving(server):
    for path, body, said in BAD:
        status, answer = post(server, path, body)
        assert status == 400 and said in json.dumps(answer), (path, body, answer)
        assert set(answer["error"]) >= {"message", "type", "param", "code"}
        status, good = post(server, "/embeddings", {"input": "still here", "encoding_format": "float"})
        assert status == 200 and len(good["data"][0]["embedding"]) == 64

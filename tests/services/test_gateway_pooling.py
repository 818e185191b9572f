"""The pooling routes' HTTP edge without an engine behind it: which ``--task`` serves which route
(each refusal a 400 naming the flag), and the bad bodies refused before anything reaches the
tokenizer, each an OpenAI error object naming its field."""

from __future__ import annotations

import pytest

from tests.services.test_gateway_validation import assert_error, gateway_client  # noqa: F401 (a fixture)

pytestmark = pytest.mark.asyncio

MSGS = [{"role": "user", "content": "hi"}]


async def test_a_generating_server_refuses_the_pooling_routes_and_a_pooling_one_the_others(gateway_client):
    generating = await gateway_client()
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"})]:
        r = await generating.post(path, json=body)
        body = await r.json()
        assert r.status == 400 and "--task embed" in body["error"]["message"], body
        assert_error(body, "model")
    pooling = await gateway_client(task="embed")
    for path, body in [("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/responses", {"input": "x"})]:
        r = await pooling.post(path, json=body)
        body = await r.json()
        assert r.status == 400 and "--task generate" in body["error"]["message"], body
        assert_error(body, "model")


EMBED_BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": [1.5, 2]}, "input"),
    ({"input": ["x"] * 5}, "input"),  # over --max-pooling-inputs 4
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
]


async def test_bad_embedding_bodies_are_400s(gateway_client):
    client = await gateway_client(task="embed", max_pooling_inputs=4)  # one gateway for them all: it keeps serving
    for body, param in EMBED_BAD:
        r = await client.post("/v1/embeddings", json=body)
        assert r.status == 400, body
        assert_error(await r.json(), param)


SCORE_BAD = [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [3]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"] * 5}, "text_2"),
]


async def test_bad_rerank_and_score_bodies_are_400s(gateway_client):
    client = await gateway_client(task="score", max_pooling_inputs=4)
    for path, body, param in SCORE_BAD:
        r = await client.post(path, json=body)
        assert r.status == 400, (path, body)
        assert_error(await r.json(), param)

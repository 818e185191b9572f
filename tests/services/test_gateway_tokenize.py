"""vLLM's ``/tokenize`` and ``/detokenize`` through the gateway and the real tokenizer service over
``ipc://`` sockets (SmolLM2's tokenizer and chat template): shapes, defaults, errors, the API key."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.services.frontend import front_half, text_tokenizer
from tests.services.openai_schema import validate

pytestmark = pytest.mark.asyncio

MODEL = "SmolLM2-135M-Instruct"
BUSY_DEADLINE_S = 60.0
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


async def post(client, path: str, **kwargs):
    """A request, sent again while the gateway answers 503: on a loaded machine the tokenizer may
    miss its health pings for a moment, and the gateway then refuses work (as it should)."""
    deadline = asyncio.get_running_loop().time() + BUSY_DEADLINE_S
    while True:
        r = await client.post(path, **kwargs)
        if r.status != 503 or asyncio.get_running_loop().time() > deadline:
            return r
        await asyncio.sleep(0.2)


async def test_tokenize_a_prompt_and_detokenize_it_back():
    hf = text_tokenizer().hf
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        r = await post(client, "/tokenize", json={"model": MODEL, "prompt": "Hello world, café 😀"})
        body = await r.json()
        assert r.status == 200, body
        ids = hf.encode("Hello world, café 😀")
        assert body == {"count": len(ids), "max_model_len": 8192, "tokens": ids, "token_strs": None}
        r = await post(client, "/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
        body = await r.json()
        assert body["token_strs"] == hf.convert_ids_to_tokens(hf.encode("Hello world"))
        r = await post(client, "/detokenize", json={"model": MODEL, "tokens": ids})
        assert (await r.json()) == {"prompt": "Hello world, café 😀"}
        # special tokens are text too: what /tokenize of a chat gave decodes to the template's text
        im_end = hf.convert_tokens_to_ids("<|im_end|>")
        r = await post(client, "/detokenize", json={"tokens": [im_end]})
        assert (await r.json())["prompt"] == "<|im_end|>"
        assert fh.tokenizer.stats["num_tokenize"] == 4


async def test_tokenize_a_chat_renders_the_template_as_chat_completions_do():
    tok = text_tokenizer()
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        body = await (await post(client, "/tokenize", json={"model": MODEL, "messages": MSGS})).json()
        await post(client, "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
        (sent,) = fh.scheduler.received
        assert body["tokens"] == sent.prompt_token_ids and body["count"] == len(sent.prompt_token_ids)
        r = await post(client, "/tokenize", json={"messages": MSGS, "add_generation_prompt": False})
        without = await r.json()
        assert body["tokens"][: without["count"]] == without["tokens"] and without["count"] < body["count"]
        assert tok.decode_with_specials(body["tokens"]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("path,req,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"prompt": "x"}, 400, "tokens"),
])
async def test_bad_bodies_get_an_openai_error(path, req, status, param):
    async with front_half() as fh, TestClient(TestServer(fh.app)) as client:
        r = await post(client, path, json=req)
        body = await r.json()
        assert r.status == status, body
        validate(body, "ErrorResponse")
        assert body["error"]["param"] == param
        r = await post(client, "/tokenize", data=b"{not json")
        assert r.status == 400
        r = await post(client, "/tokenize", json={"prompt": "still serving"})
        assert r.status == 200  # the tokenizer kept serving


async def test_tokenize_is_behind_the_api_key_and_answers_503_without_a_tokenizer():
    async with front_half(api_key="sekret") as fh, TestClient(TestServer(fh.app)) as client:
        for path, req in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = await post(client, path, json=req)
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            r = await post(client, path, json=req, headers={"Authorization": "Bearer sekret"})
            assert r.status == 200
        fh.tasks[0].cancel()  # the tokenizer service stops answering
        await asyncio.sleep(0.5)  # a ping already on its way is answered or given up by now
        fh.gateway.health.states["tokenizer"].last_ok = None
        r = await client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer sekret"})
        assert r.status == 503

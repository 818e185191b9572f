"""An encoder-only model through the real stack (``folio serve --task embed``: five processes,
ipc:// sockets, HTTP): a tiny random BERT written as sentence-transformers saves it, against
sentence-transformers' ``encode`` on the same folder, through the official ``openai`` client's
``embeddings.create`` (floats and base64, ``dimensions``); too long an input is a 400 and the server serves on;
``--task generate`` is refused at start."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import openai
import pytest

from folio.testing.models import write_tiny_bert_embedding_model
from folio.testing.server import post_json, served
from tests.folio.test_bert_embedding import TEXTS, cosine

FLAGS = ["--task", "embed", "--dtype", "float32", "--num-kv-blocks", "64", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "256", "--served-model-name", "tiny-bert"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_bert_embedding_model(tmp_path_factory.mktemp("bert-served"))


def post(server, path: str, body: dict) -> tuple[int, dict]:
    return post_json(server.base_url + path, body)


@pytest.mark.slow
def test_served_embeddings_match_sentence_transformers_and_refuse_too_long(model):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(model, device="cpu").encode(TEXTS)
    with served(model, *FLAGS) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        floats = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
        decoded = client.embeddings.create(model="tiny-bert", input=TEXTS)  # base64, decoded by the client
        for f, d, w in zip(floats.data, decoded.data, want):
            assert cosine(f.embedding, w) >= 0.9999
            np.testing.assert_allclose(d.embedding, f.embedding, atol=1e-6)
        short = client.embeddings.create(model="tiny-bert", input=TEXTS[:2], dimensions=16, encoding_format="float")
        for got, w in zip(short.data, want):
            assert len(got.embedding) == 16 and cosine(got.embedding, w[:16]) >= 0.9999
            assert abs(np.linalg.norm(got.embedding) - 1.0) < 1e-5  # the first 16 values, renormalised
        with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
            client.embeddings.create(model="tiny-bert", input="the cat " * 40)
        with pytest.raises(openai.BadRequestError, match="this server pools"):
            client.completions.create(model="tiny-bert", prompt="the cat", max_tokens=2)
        status, body = post(server, "/rerank", {"model": "tiny-bert", "query": "cat", "documents": ["the cat"]})
        assert status == 400 and "encoder-only" in body["error"]["message"]
        again = client.embeddings.create(model="tiny-bert", input=TEXTS[2], encoding_format="float")
        assert cosine(again.data[0].embedding, want[2]) >= 0.9999


@pytest.mark.parametrize("flags, said", [(["--task", "generate"], "it generates no text; serve it with --task embed"),
                                         (["--task", "embed", "--quantization", "int8"], "unquantized")])
def test_serve_refuses_at_start_what_an_encoder_only_model_cannot_do(model, tmp_path, flags, said):
    run = subprocess.run([sys.executable, "-m", "folio.cli.main", "serve", "--model", model, *flags,
                          "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "encoder-only model" in run.stderr and said in run.stderr

"""Pooling offline (``folio.LLM(task=...)``) against transformers on the same random weights, fp32:
embeddings of a Qwen3-Embedding-shaped checkpoint (the final norm's output at the last token, the
tokenizer's appended ``<|endoftext|>``, normalised) with a cosine of at least 0.9999 for every
input, whether batched, chunked over several steps or found partly in the prefix cache; Matryoshka
``dimensions``; a Qwen3-Reranker-shaped yes/no score equal to transformers' softmax of the two
logits within 1e-4, in the same order; and the refusals."""

from __future__ import annotations

import pytest
import torch

from folio import LLM
from folio.core.input_processor import RerankFormat
from folio.testing.models import write_tiny_embedding_model, write_tiny_qwen3_chat_model

ENGINE = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64}
WORDS = ("the harbour lights dim slowly while a ferry crosses the bay and gulls follow it home across "
         "grey water under a low sky ").split()
TEXTS = ["hi", "A short sentence.", " ".join(WORDS[:20]), " ".join(WORDS * 4), " ".join(WORDS[5:] * 9)]
QUERY = "Which city is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bread rises when yeast ferments.", "France borders Spain.",
        "The Seine flows through Paris, France's capital city.", "Gulls follow ferries."]


@pytest.fixture(scope="module")
def emb_model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_embedding_model(tmp_path_factory.mktemp("tiny-embed"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def emb_llm(emb_model) -> LLM:
    return LLM(emb_model, task="embed", **ENGINE)


@pytest.fixture(scope="module")
def reference(emb_model):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(emb_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(emb_model)


def reference_embedding(reference, ids: list[int]) -> torch.Tensor:
    model, _ = reference
    with torch.no_grad():
        last = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last, dim=0)


def cosine(a, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


def test_embeddings_match_transformers_for_every_input_batched_and_chunked(emb_llm, reference):
    outs = emb_llm.embed(TEXTS + [[5, 9, 200, 31]], use_tqdm=False)
    ids = [reference[1](t)["input_ids"] for t in TEXTS] + [[5, 9, 200, 31]]
    assert ids[0][-1] == reference[1].convert_tokens_to_ids("<|endoftext|>")  # appended as the tokenizer does
    assert max(len(i) for i in ids) > 2 * ENGINE["max_num_batched_tokens"]  # some ran over several steps
    for out, want in zip(outs, ids):
        assert out.prompt_token_ids == want
        assert len(out.outputs.embedding) == 64
        assert abs(float(torch.tensor(out.outputs.embedding).norm()) - 1) < 1e-5
        assert cosine(out.outputs.embedding, reference_embedding(reference, want)) >= 0.9999


def test_a_shared_prefix_is_a_cache_hit_with_the_same_embedding(emb_llm, reference):
    long = " ".join(WORDS * 3)
    emb_llm.embed([long], use_tqdm=False)
    out = emb_llm.embed([long + " and then the night"], use_tqdm=False)[0]
    assert out.num_cached_tokens >= 32  # whole blocks of the first one's prompt
    assert cosine(out.outputs.embedding, reference_embedding(reference, out.prompt_token_ids)) >= 0.9999


def test_dimensions_truncate_then_renormalise(emb_llm, reference):
    out = emb_llm.embed(["A short sentence."], dimensions=16, use_tqdm=False)[0]
    model, _ = reference
    with torch.no_grad():
        last = model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
    want = torch.nn.functional.normalize(last[:16], dim=0)
    assert len(out.outputs.embedding) == 16 and cosine(out.outputs.embedding, want) >= 0.9999


def test_pooling_refusals_say_why(emb_llm):
    with pytest.raises(ValueError, match="empty"):
        emb_llm.embed([""], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        emb_llm.embed([list(range(1, 600))], use_tqdm=False)
    with pytest.raises(ValueError, match="at most the model's 64"):
        emb_llm.embed(["hi"], dimensions=65, use_tqdm=False)
    with pytest.raises(ValueError, match="task='generate'"):
        emb_llm.generate(["hi"], use_tqdm=False)
    assert len(emb_llm.embed(["still serving"], use_tqdm=False)[0].outputs.embedding) == 64


@pytest.fixture(scope="module")
def rerank_model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_qwen3_chat_model(tmp_path_factory.mktemp("tiny-rerank"), smollm_tokenizer_dir)


def reference_scores(model_dir: str, fmt: RerankFormat, query: str, docs: list[str]) -> list[float]:
    """Qwen3-Reranker's recipe in transformers: the formatted pair, the last position's logits of
    "no" and "yes", p(yes) from their softmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    for doc in docs:
        ids = tokenizer(fmt.prompt(query, doc), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, [no, yes]]
        scores.append(float(torch.softmax(logits, dim=0)[1]))
    return scores


def test_rerank_scores_match_transformers_yes_no_logits(rerank_model):
    llm = LLM(rerank_model, task="score", **ENGINE)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    want = reference_scores(rerank_model, llm.rerank_format, QUERY, DOCS)
    assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-4
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert len(set(round(w, 4) for w in want)) == len(DOCS)  # distinct scores: the order means something


def test_a_generating_llm_refuses_to_pool(rerank_model):
    llm = LLM(rerank_model, **ENGINE)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.score(QUERY, DOCS, use_tqdm=False)

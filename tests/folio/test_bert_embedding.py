"""Encoder-only embeddings offline (``folio.LLM(task="embed")``) on tiny random BERTs written as
sentence-transformers saves them, against sentence-transformers' ``encode`` on the same folder,
fp32: mean pooling + Normalize and CLS pooling, inputs of several lengths in one step; attention
that is bidirectional and stays within each input; no prefix-cache hit for an encoder's input;
the checkpoint's pooling config in both of sentence-transformers' formats; and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from folio import LLM
from folio.core.executor.model.bert import sentence_pooling
from folio.testing.models import write_tiny_bert_embedding_model

ENGINE = {"dtype": "float32", "num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 256}
TEXTS = ["a", "hello world", "The cat sat on the mat, and the dog sat too!",
         "embedding models of the world, " * 6, "the mat; the cat: the dog (sat)"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {mode: write_tiny_bert_embedding_model(tmp_path_factory.mktemp(f"bert-{mode}"), pooling=mode)
            for mode in ("mean", "cls")}


@pytest.fixture(scope="module")
def llms(folders) -> dict[str, LLM]:
    return {mode: LLM(folder, task="embed", **ENGINE) for mode, folder in folders.items()}


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def embed(llm: LLM, texts) -> list[np.ndarray]:
    return [np.asarray(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]


def steps_of(llm: LLM, texts) -> int:
    """The engine steps ``llm.embed(texts)`` takes (a step that computes, and the one that ends)."""
    before = llm.stats()["num_steps"]
    llm.embed(texts, use_tqdm=False)
    return llm.stats()["num_steps"] - before


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_embeddings_match_sentence_transformers_in_one_step(mode, folders, llms):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(folders[mode], device="cpu").encode(TEXTS)
    llm = llms[mode]
    assert steps_of(llm, TEXTS) == steps_of(llm, TEXTS[:1])  # every input in one step, beside the others
    outs = llm.embed(TEXTS, use_tqdm=False)
    lengths = {len(o.prompt_token_ids) for o in outs}
    assert len(lengths) == len(TEXTS) and max(lengths) > 30
    tokenizer = llm.get_tokenizer()
    assert outs[1].prompt_token_ids[0] == tokenizer.cls_token_id and outs[1].prompt_token_ids[-1] == tokenizer.sep_token_id
    for out, w in zip(outs, want):
        got = np.asarray(out.outputs.embedding)
        assert cosine(got, w) >= 0.9999
        assert abs(np.linalg.norm(got) - 1.0) < 1e-5  # the checkpoint's Normalize module


def test_attention_is_bidirectional_and_within_each_input(llms):
    llm = llms["cls"]
    # the CLS vector is position 0's: a causal layer would give both the same vector
    first, second = embed(llm, ["the cat sat on the mat", "the cat sat on the dog"])
    assert cosine(first, second) < 0.999
    alone = embed(llm, [TEXTS[2]])[0]
    together = embed(llm, [TEXTS[3], TEXTS[2], TEXTS[4]])
    assert steps_of(llm, [TEXTS[3], TEXTS[2], TEXTS[4]]) == steps_of(llm, [TEXTS[2]])  # in one step with the others
    np.testing.assert_allclose(together[1], alone, atol=1e-5)


def test_an_input_is_never_served_from_the_prefix_cache(llms):
    llm = llms["mean"]
    long_text = "embedding models of the world, " * 7  # many whole blocks
    first = llm.embed([long_text], use_tqdm=False)[0]
    again = llm.embed([long_text], use_tqdm=False)[0]
    assert len(first.prompt_token_ids) > 32
    assert again.num_cached_tokens == 0
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-6)


def test_both_sentence_transformers_pooling_formats_are_read(tmp_path):
    assert sentence_pooling(tmp_path) == ("mean", True)  # no sentence-transformers files: the documented default
    (tmp_path / "1_Pooling").mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    legacy = {"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    assert sentence_pooling(tmp_path) == ("cls", False)  # no Normalize module
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(ValueError, match="one of mean, cls"):
        sentence_pooling(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert sentence_pooling(tmp_path) == ("mean", True)


def test_refusals(folders, llms):
    llm = llms["mean"]
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.embed(["the cat " * 40], use_tqdm=False)
    with pytest.raises(ValueError, match="encoder-only"):
        llm.score("the cat", ["the dog"], use_tqdm=False)
    assert len(embed(llm, ["still serving"])) == 1
    with pytest.raises(ValueError, match="encoder-only model \\(bert\\).*--task embed"):
        LLM(folders["mean"], task="generate", **ENGINE)
    with pytest.raises(ValueError, match="unquantized"):
        LLM(folders["mean"], task="embed", quantization="int8", **ENGINE)


def test_an_input_over_the_step_budget_is_refused(folders):
    llm = LLM(folders["mean"], task="embed", **{**ENGINE, "max_num_batched_tokens": 16})
    with pytest.raises(ValueError, match="computes each input whole in one step"):
        llm.embed(["the cat sat on the mat and the dog sat on the cat, " * 2], use_tqdm=False)  # 30 tokens
    assert len(embed(llm, ["the cat"])) == 1


def test_without_a_normalize_module_the_vector_keeps_its_norm(tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = write_tiny_bert_embedding_model(tmp_path / "bert-raw", normalize=False)
    want = SentenceTransformer(folder, device="cpu").encode(TEXTS[:3])
    got = embed(LLM(folder, task="embed", **ENGINE), TEXTS[:3])
    for g, w in zip(got, want):
        assert abs(np.linalg.norm(w) - 1.0) > 0.01  # (the pooled vector is not a unit one)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_batch_invariant_mode_on_the_cpu_backend_flag(folders):
    """``--attention-backend cpu`` and ``--batch-invariant`` run an encoder on the torch path (its
    layers attend on their own): an input's vector is the same bits alone and beside others."""
    from sentence_transformers import SentenceTransformer

    llm = LLM(folders["mean"], task="embed", attention_backend="cpu", batch_invariant=True, **ENGINE)
    alone = embed(llm, [TEXTS[3]])[0]
    together = embed(llm, [TEXTS[2], TEXTS[3], TEXTS[0]])
    assert np.array_equal(together[1], alone)
    want = SentenceTransformer(folders["mean"], device="cpu").encode(TEXTS[3])
    assert cosine(alone, want) >= 0.9999


@pytest.mark.parametrize("field, value, said", [("position_embedding_type", "relative_key", "absolute only"),
                                                ("hidden_act", "relu", "gelu only"),
                                                ("is_decoder", True, "encoders only")])
def test_bert_configs_folio_does_not_run_are_refused(field, value, said):
    from transformers import BertConfig

    from folio.core.executor.model.registry import model_spec

    config = BertConfig(num_hidden_layers=1)
    assert model_spec(config).model_type == "bert"
    setattr(config, field, value)
    with pytest.raises(ValueError, match=said):
        model_spec(config)

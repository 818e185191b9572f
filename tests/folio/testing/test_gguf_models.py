"""The random-weight Llama writer behind the 1B benchmark shape, at a tiny shape: written a layer per
shard, converted by llama.cpp's ``convert_hf_to_gguf.py``, quantized to Q4_1 by its ``llama-quantize``
(skipped when that is not built), and served by folio. The 1B shape itself is data checked against
Llama-3.2-1B's published size; writing it takes minutes (``python -m folio.testing.gguf_models 1b``)."""

from __future__ import annotations

import pytest

from folio.testing.gguf_models import (
    LLAMA_1B, LLAMA_3B, TINY_LLAMA, bench_gguf_path, llama_shape_key, write_llama_gguf,
)
from folio.testing.llamacpp import find_llama_quantize

gguf = pytest.importorskip("gguf")


def test_the_1b_shape_has_llama_3_2_1bs_parameter_count():
    s = LLAMA_1B
    hidden, dim = s["hidden_size"], s["head_dim"]
    attention = hidden * dim * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    layer = attention + 3 * hidden * s["intermediate_size"] + 2 * hidden
    total = s["vocab_size"] * hidden + s["num_hidden_layers"] * layer + hidden  # tied head
    assert total == 1_235_814_400  # Llama-3.2-1B's safetensors: 1.24B parameters
    assert s["num_attention_heads"] * dim == hidden and s["tie_word_embeddings"]
    keys = {llama_shape_key(shape, q) for shape in (LLAMA_1B, LLAMA_3B, TINY_LLAMA) for q in ("Q4_0", "Q4_1")}
    assert len(keys) == 6


def parameters(s: dict) -> int:
    hidden, dim = s["hidden_size"], s["head_dim"]
    attention = hidden * dim * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    layer = attention + 3 * hidden * s["intermediate_size"] + 2 * hidden
    return s["vocab_size"] * hidden + s["num_hidden_layers"] * layer + hidden  # tied head


def test_the_3b_shape_has_llama_3_2_3bs_parameter_count():
    assert parameters(LLAMA_3B) == 3_212_749_824  # Llama-3.2-3B's safetensors: 3.21B parameters
    assert LLAMA_3B["num_attention_heads"] * LLAMA_3B["head_dim"] == LLAMA_3B["hidden_size"]


def test_each_benchmark_file_has_its_own_place_and_smollm2s_q4_1_is_the_packaged_file():
    from folio.core.model_files import packaged_gguf

    assert bench_gguf_path("smollm2", "Q4_1") == packaged_gguf()
    paths = {bench_gguf_path(shape, q) for shape in ("smollm2", "1b", "3b") for q in ("BF16", "Q4_0", "Q4_K_M", "Q8_0")}
    assert len(paths) == 12
    assert bench_gguf_path("1b", "q4_k_m") == bench_gguf_path("1b", "Q4_K_M")
    with pytest.raises(ValueError, match="unknown shape"):
        bench_gguf_path("8b", "Q4_0")


@pytest.mark.slow  # over 8 s: the full suite's
@pytest.mark.skipif(find_llama_quantize() is None,
                    reason="llama-quantize is not built: `python -m folio.testing.llamacpp` builds it")
def test_the_writer_at_a_tiny_shape_goes_through_llamacpp_and_folio_serves_it(tmp_path):
    from folio import LLM, SamplingParams

    path = write_llama_gguf(tmp_path / "tiny-q4_1.gguf", TINY_LLAMA, "Q4_1", log=None)
    reader = gguf.GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == TINY_LLAMA["num_hidden_layers"]
    assert fields["llama.embedding_length"] == TINY_LLAMA["hidden_size"]
    assert fields["llama.attention.head_count_kv"] == TINY_LLAMA["num_key_value_heads"]
    assert fields["llama.rope.freq_base"] == 500000.0
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == TINY_LLAMA["vocab_size"]  # padded by the converter
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" not in types and "rope_freqs.weight" in types  # tied head; Llama 3's RoPE divisors
    assert {types[n] for n in types if n.startswith("blk.") and not n.endswith("norm.weight")} == {
        gguf.GGMLQuantizationType.Q4_1}  # every projection

    llm = LLM(model=str(path), num_kv_blocks=16, block_size=16)
    out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4

"""GGUF files served in their own types on the CPU (``model/gguf_weights.py``): every type the kernels
read, and llama.cpp's Q4_K_M mix, against the same file loaded dense (gguf-py's dequantization:
code independent of folio's repacking). The files are small llamas of random blocks
(``folio.testing.gguf_blocks``), so the weights are exactly the blocks' values."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.quant import cpu_gemm
from folio.core.executor.quant.linear import QuantEmbedding, QuantLinear, QuantLMHead
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.testing.gguf_blocks import Q4_K_M, all_of, write_llama_gguf

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler for the CPU kernels")
PROMPT = list(range(5, 30))
FILES = {"Q4_K_M": Q4_K_M, **{t: all_of(t) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K",
                                                     "IQ4_NL", "IQ4_XS")}}


@pytest.fixture(autouse=True)
def no_prepared_cache(monkeypatch):
    monkeypatch.setenv("FOLIO_MODEL_CACHE", "0")


def runner_for(path, quantization: str = "auto") -> ModelRunner:
    return ModelRunner(RuntimeConfig(num_kv_blocks=16, block_size=8, quantization=quantization), str(path))


def prompt_logits(runner: ModelRunner, prompt=PROMPT) -> torch.Tensor:
    n = len(prompt)
    meta = AttentionMetadata.build([n], [n], [[0, 1, 2, 3]], torch.arange(n), 8)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), torch.arange(n), runner.pool.kv_caches, meta, runner.backend)
        return runner.model.compute_logits(hidden)


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_gguf_is_served_in_its_own_types(name, tmp_path):
    path = write_llama_gguf(tmp_path / f"{name}.gguf", FILES[name], seed=len(name))
    native, dense = runner_for(path), runner_for(path, "none")
    model = native.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.packed_lm_head, QuantLMHead)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4 and all(m.weight_packed is not None for m in linears)
    kinds = set(FILES[name].values())
    assert {t for m in linears for t in m.weight_packed.types} | {*model.embed_tokens.table.types} == kinds
    assert sum(model.weight_types.values()) == 2 * 7 + 1  # each tensor repacked once, q/k/v and gate/up fused
    assert model.quantization == {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}.get(name, "gguf")
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # nothing dense but norms
    want, got = prompt_logits(dense), prompt_logits(native)
    # two int8 passes of the activations (about 15 bits) against the file's own weights
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95
    # the embedding keeps its input's shape as nn.Embedding does (the eagle3 head looks up [B, T] ids)
    ids = torch.tensor([[1, 5, 7], [2, 2, 9]])
    table = model.embed_tokens(ids)
    assert table.shape == (2, 3, model.spec.hidden_size)
    assert torch.equal(table[1], model.embed_tokens(ids[1])) and torch.equal(table, dense.model.embed_tokens(ids))


def test_a_mixed_file_runs_its_decodes_in_the_one_call_stack(tmp_path):
    """Q4_K_M fuses q/k (Q4_K) with v (Q6_K): one weight of two parts, through the stack's one call;
    greedy tokens equal the dense model's."""
    from folio.shared.sampling import SamplingParams
    from tests.executor.toy_driver import generate

    path = write_llama_gguf(tmp_path / "m.gguf", Q4_K_M, seed=3)
    native, dense = runner_for(path), runner_for(path, "none")
    assert native.model.layers[0].self_attn.qkv_proj.weight_packed.types == ["Q4_K", "Q6_K"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [list(range(3, 20)), [7, 8, 9]]
    assert generate(native, prompts, params) == generate(dense, prompts, params)
    assert native.backend.stack.num_calls >= 9


def test_an_untied_head_and_a_type_without_a_kernel(tmp_path):
    """An output.weight of its own (Q6_K) is the head; a Q3_K projection, which no kernel reads, is
    rounded to Q8_0 blocks (said in the log) rather than expanded to fp32."""
    types = {**Q4_K_M, "output": "Q6_K", "ffn_up": "Q3_K"}
    from folio.testing import gguf_blocks

    gguf_blocks.FP16_AT.setdefault("Q3_K", [108])
    path = write_llama_gguf(tmp_path / "m.gguf", types, tied=False)
    native, dense = runner_for(path), runner_for(path, "none")
    assert native.model.packed_lm_head.tiles.types == ["Q6_K"]
    assert native.model.layers[0].mlp.gate_up_proj.weight_packed.types == ["Q4_K", "Q8_0"]
    want, got = prompt_logits(dense), prompt_logits(native)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def test_the_prepared_form_is_cached_and_mapped(tmp_path, monkeypatch):
    from folio.core.executor.model import loader
    from folio.core.executor import startup

    monkeypatch.setenv("FOLIO_MODEL_CACHE", "1")
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "PREPARED_MIN_BUILD_S", 0.0)
    path = write_llama_gguf(tmp_path / "m.gguf", Q4_K_M)
    first = prompt_logits(runner_for(path))
    assert startup.NOTES["weights_cache"] == "miss"
    again = runner_for(path)
    assert startup.NOTES["weights_cache"] == "hit"
    assert torch.equal(prompt_logits(again), first)


def test_explicit_methods_keep_their_meaning(tmp_path):
    """``int4`` on a Q4_0 file is the file's own blocks; ``int4`` on a K-quant file rounds its values
    to folio's int4 groups (what the user asked for); ``none`` is dense."""
    q4 = write_llama_gguf(tmp_path / "q4.gguf", all_of("Q4_0"))
    assert runner_for(q4, "int4").model.layers[0].mlp.down_proj.weight_packed.types == ["Q4_0"]
    k = write_llama_gguf(tmp_path / "k.gguf", Q4_K_M)
    assert runner_for(k, "int4").model.layers[0].mlp.down_proj.weight_packed.types == ["Q4_1"]
    assert not any(isinstance(m, QuantLinear) for m in runner_for(k, "none").model.modules())


def test_one_activation_pass_is_asked_for_by_flag(tmp_path):
    """``--cpu-activation-passes 1``: the layers, the head and the stack take one int8 pass (close to two,
    not the same bits); two is the default."""
    path = write_llama_gguf(tmp_path / "m.gguf", Q4_K_M)
    two = runner_for(path)
    assert QuantLinear.passes == 2
    want = prompt_logits(two)
    one = ModelRunner(RuntimeConfig(num_kv_blocks=16, block_size=8, cpu_activation_passes=1), str(path))
    assert QuantLinear.passes == 1
    assert one.model.stack_layout(one.pool.kv_caches).stack.passes == 1
    got = prompt_logits(one)
    assert not torch.equal(got, want)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.1  # 8 bits of x, on random-block weights
    QuantLinear.passes = 2  # the class's default, for the tests after this one

"""Mixture-of-experts under tensor parallelism and with quantized experts, and the int8/int4 paths
of each family against their dequantized references.

Tensor parallel 2 over gloo: Qwen3-MoE (5 experts, top-3, renormalised) and Qwen2-MoE (a shared
expert, raw top-k weights), greedy tokens and top-5 logprobs against transformers in fp32 through
the real scheduler, each rank holding half of every expert. Quantized: each family's model loaded
``int8``/``int4`` (served through the C kernel backend, bf16 activations) against the same model
with every projection replaced by its dequantized weights (fp32, the torch backend): the logits'
cosine and the greedy choice at the positions of a prompt. The families: Qwen3 (dense), Qwen3-MoE
(a dense layer among sparse ones), Qwen2-MoE (a shared expert), Gemma 2 and Phi-3.
"""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.model.loader import load_model
from folio.core.executor.model.moe import MoE
from folio.core.executor.quant.formats import quantize_int4, quantize_int8
from folio.core.executor.quant.linear import QuantLinear
from folio.core.executor.runtime.runner import ModelRunner, make_backend
from folio.shared.config import RuntimeConfig
from folio.testing.models import write_tiny_model
from tests.executor.test_model_families import FAMILIES, PROMPTS, check_against_reference, run

GROUP = 32
CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["qwen3_moe-norm", "qwen2_moe-shared"])
def test_moe_over_two_ranks(tmp_path, name):
    """Every rank half of each expert's intermediate size (and of the shared expert's), the router
    replicated; one all-reduce per block. Exact against transformers in fp32."""
    from transformers import AutoModelForCausalLM

    from folio.core.executor.runtime.workers import ParallelRunner

    model_type, overrides = FAMILIES[name]
    path = write_tiny_model(tmp_path / name, model_type, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    failures: list[str] = []
    config = RuntimeConfig(model=path, device="cpu", dtype="float32", quantization="none", block_size=8,
                           num_kv_blocks=96, tensor_parallel_size=2)
    runner = ParallelRunner(config, path, on_failure=failures.append)
    try:
        moe = runner.model.layers[0].mlp
        assert isinstance(moe, MoE) and moe.comm is not None
        half, hidden = overrides["moe_intermediate_size"] // 2, hf.config.hidden_size
        assert moe.intermediate_size == half
        gate_up, down = moe.expert(0)  # oneDNN-packed: [hidden] -> [2 half], [half] -> [hidden]
        assert (gate_up.out_features, down.out_features) == (2 * half, hidden)
        assert len(moe.packed_experts) == 5
        if moe.shared_expert is not None:
            assert moe.shared_expert.intermediate_size == overrides["shared_expert_intermediate_size"] // 2
        for prompt, (tokens, lps, _) in zip(PROMPTS[:4], run(runner, PROMPTS[:4], budget=16)):
            check_against_reference(hf, prompt, tokens, lps)
    finally:
        runner.close()
    assert not failures


def test_experts_that_do_not_split_are_refused_before_any_rank_starts(tmp_path):
    from folio.core.executor.runtime.workers import _check_model

    path = write_tiny_model(tmp_path / "odd", "qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=34)
    with pytest.raises(ValueError, match=r"the experts' intermediate size \(34\) does not divide by .* 4"):
        _check_model(path, 4)


# ------------------------------------------------------------------------------------- quantized
QUANT_FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=16, intermediate_size=64)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, norm_topk_prob=True, num_experts=5, num_experts_per_tok=3,
                                    moe_intermediate_size=32, mlp_only_layers=[1], intermediate_size=64)),
    "qwen2_moe-shared": ("qwen2_moe", dict(norm_topk_prob=False, num_experts=5, num_experts_per_tok=3,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "gemma2": FAMILIES["gemma2"],  # GeGLU, soft-caps, a window, tied embeddings
    "phi3": FAMILIES["phi3"],  # fused qkv_proj/gate_up_proj checkpoint tensors
}
PROMPT = [(11 * j + 5) % 127 + 1 for j in range(24)]


def _logits(model, ids, backend) -> torch.Tensor:
    spec, n = model.spec, len(ids)
    shape = (n, 1, spec.num_kv_heads, spec.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(n))], None, 1)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), meta.positions, kv, meta, backend))


def _dequantized_reference(path: str, method: str):
    """The fp32 model with every projection (attention, dense MLPs, shared experts, each routed
    expert) replaced by its rounded-to-nearest weights dequantized; routers and shared-expert
    gates as they are."""
    rounded = (lambda w: quantize_int8(w).dequantize()) if method == "int8" \
        else (lambda w: quantize_int4(w, GROUP).dequantize())
    model = load_model(path, torch.float32, CPU, "none")
    replaced = 0
    for name, p in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            p.copy_(rounded(p))
            replaced += 1
        elif name.endswith(("experts_gate_up", "experts_down")):  # [experts, out, in]: each expert's own
            p.copy_(torch.stack([rounded(w) for w in p]))
            replaced += 1
    assert replaced >= 4 * model.spec.num_layers - 2 * sum(model.spec.moe_layers)
    return model


@pytest.fixture(scope="module", params=sorted(QUANT_FAMILIES))
def quant_family(request, tmp_path_factory):
    model_type, overrides = QUANT_FAMILIES[request.param]
    return request.param, write_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_family_matches_its_dequantized_reference(quant_family, method):
    name, path = quant_family
    served = load_model(path, torch.float32, CPU, method, group_size=GROUP)
    assert served.quantization == method
    quantized = [m for m in served.modules() if isinstance(m, QuantLinear)]
    assert all(m.bits == int(method[3:]) for m in quantized)
    for layer, sparse in zip(served.layers, served.spec.moe_layers or [False] * served.spec.num_layers):
        if sparse:  # each expert's pair packed, the stacked fp32 copies gone, the router fp32
            moe = layer.mlp
            assert moe.experts_gate_up is None and moe.gate.weight.dtype == torch.float32
            assert all(isinstance(lin, QuantLinear) for pair in moe.packed_experts for lin in pair)
            assert len(moe.packed_experts) == served.spec.num_experts
    backend = make_backend("auto", CPU, torch.float32, torch.float32, served)  # the C kernels, bf16 activations
    assert backend.name == "cpu"
    got = _logits(served, PROMPT, backend)
    ref = _logits(_dequantized_reference(path, method), PROMPT, TorchAttentionBackend())
    if not name.startswith("gemma"):  # (Gemma's GeGLU and soft-caps take the torch reference ops on the CPU)
        assert backend.layer_ops.num_fallbacks == 0
    # served = its dequantized weights up to bf16 activations and scales
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.999, cos
    # the greedy choice at (nearly) every position: random tiny models have near-ties (measured 92-100%
    # here; against the other method's reference 48-61%)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    # and the dequantized reference is not the fp32 model itself (the rounding bites)
    dense = _logits(load_model(path, torch.float32, CPU, "none"), PROMPT, TorchAttentionBackend())
    assert (dense - ref).abs().max() > 1e-3


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_runner_serves_a_quantized_moe(tmp_path, method):
    """The serving path: the runner leaves quantized experts out of oneDNN packing and picks the
    C kernels; greedy decoding through the scheduler runs to the end."""
    model_type, overrides = QUANT_FAMILIES["qwen2_moe-shared"]
    path = write_tiny_model(tmp_path / "m", model_type, **overrides)
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, block_size=8, quantization=method), path)
    assert runner.stats()["quantization"] == method and runner.backend.name == "cpu"
    assert all(isinstance(lin, QuantLinear) for pair in runner.model.layers[0].mlp.packed_experts for lin in pair)
    ((tokens, _, _), (tokens2, _, _)) = run(runner, PROMPTS[:2], budget=16)
    assert len(tokens) == len(tokens2) == 12

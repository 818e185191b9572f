"""GGUF checkpoints of every architecture llama.cpp writes, against the safetensors folders they were
converted from.

Each case writes a tiny random-weight model with its ``transformers`` config class, then a GGUF of
it with the ``gguf`` package's writer, as llama.cpp's ``convert_hf_to_gguf.py`` does: its metadata
keys, gguf-py's tensor names (``get_tensor_name_map``), llama's q/k rows permuted for its RoPE,
experts stacked into 3-D tensors, Gemma's norms with the ``+1`` added, Phi-3's fused projections
kept. folio loads both; the GGUF must give the same spec, the same weights and the same logits
(F32: exact up to the fp32 metadata's rounding). One quantized file (Q4_0 attention, Q4_1 MLP, a
permuted llama) must load its projections into the int4 path unchanged and match a folder holding
its dequantized weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.model.loader import load_model, read_checkpoint
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.testing.models import write_tiny_model

gguf = pytest.importorskip("gguf")

MOE = dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6, tie_word_embeddings=True)
CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    # Llama 3's RoPE scaling, which llama.cpp writes as a rope_freqs tensor of divisors
    "llama3-rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mixtral": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=64,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("qwen2", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, norm_topk_prob=True, **MOE)),
    "qwen2_moe": ("qwen2_moe", dict(norm_topk_prob=False, shared_expert_intermediate_size=48, **MOE)),
    # llama.cpp scales Gemma's queries by head_dim ** -0.5 (hidden / heads for the 27B models) and
    # ties the head; windows shorter than the prompt and soft-caps that bite
    "gemma2": ("gemma2", dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0, **GEMMA)),
    # six layers: five local, one global (llama.cpp's fixed pattern); its own global RoPE scaling
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, rope_parameters={
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **GEMMA)),
    # LongRoPE past an original context of 8 (the factors as llama.cpp's tensors), a window of 6
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=8, sliding_window=6, pad_token_id=0,
                                   eos_token_id=2, rope_parameters={
                                       "rope_type": "longrope", "rope_theta": 1e4,
                                       "long_factor": [1.0 + i / 4 for i in range(8)],
                                       "short_factor": [1.0 + i / 16 for i in range(8)]})),
}
ARCH = {"llama": "LLAMA", "mixtral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "qwen2_moe": "QWEN2MOE",
        "qwen3_moe": "QWEN3MOE", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3", "phi3": "PHI3"}
PROMPT = [3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33, 2, 90]


# ---------------------------------------------------------------------------- llama.cpp's converter
def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``LlamaModel.permute``: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_metadata(w, c: dict, model_type: str) -> None:
    layers = c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if model_type == "gemma2":  # Gemma2Model.set_gguf_parameters (no RoPE base: llama.cpp's default)
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
        return
    if model_type == "phi3":  # Phi3MiniModel.set_gguf_parameters
        w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(c.get("sliding_window") or 0)
        return
    # TextModel.set_gguf_parameters
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    experts = c.get("num_local_experts") or c.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if model_type in ("llama", "mixtral"):  # LlamaModel
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // heads)
    if model_type in ("qwen2_moe", "qwen3_moe"):  # Qwen2MoeModel
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if model_type == "gemma3_text":
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])


def converted_tensors(folder: Path, c: dict, model_type: str) -> dict[str, torch.Tensor]:
    """HF tensors -> llama.cpp's, transformed as its converter transforms them."""
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCH[model_type]], c["num_hidden_layers"])
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    experts: dict[str, list] = {}
    out = {}
    for name, t in sorted(state.items()):
        if model_type in ("llama", "mixtral") and name.endswith("q_proj.weight"):
            t = permute(t, heads)
        if model_type in ("llama", "mixtral") and name.endswith("k_proj.weight"):
            t = permute(t, kv)
        if model_type in ("gemma2", "gemma3_text") and name.endswith("norm.weight"):
            t = t + 1
        if model_type in ("gemma2", "gemma3_text") and name == "lm_head.weight":
            continue  # llama.cpp's Gemma ties the head
        if ".experts." in name:  # model.layers.{i}.<block>.experts.{e}.<w>.weight: stacked over e
            parts = name.split(".")
            e = parts.index("experts")
            experts.setdefault(".".join(parts[:e + 1] + parts[e + 2:]), []).append((int(parts[e + 1]), t))
            continue
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t
    for name, ts in experts.items():
        stacked = torch.stack([t for _, t in sorted(ts, key=lambda x: x[0])])  # [experts, out, in]
        out[names.get_name(name, try_suffixes=(".weight",))] = stacked
    assert None not in out, "a tensor llama.cpp has no name for"
    return out


def extra_tensors(c: dict, model_type: str) -> dict[str, torch.Tensor]:
    """``generate_extra_tensors``: Llama 3's RoPE divisors (``LlamaModel``), Phi-3's LongRoPE factors."""
    rope = c.get("rope_parameters") or {}
    if model_type == "llama" and rope.get("rope_type") == "llama3":
        dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
        divisors = []
        for wavelen in (2 * torch.pi / freqs).tolist():
            if wavelen < old / high:
                divisors.append(1.0)
            elif wavelen > old / low:
                divisors.append(rope["factor"])
            else:
                smooth = (old / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        return {"rope_freqs.weight": torch.tensor(divisors, dtype=torch.float32)}
    if model_type != "phi3" or rope.get("rope_type") not in ("longrope", "su"):
        return {}
    return {"rope_factors_long.weight": torch.tensor(rope["long_factor"]),
            "rope_factors_short.weight": torch.tensor(rope["short_factor"])}


def to_gguf(folder: str, path: Path, quantize=None) -> Path:
    """``folder`` as llama.cpp would convert it; ``quantize(gguf_name)`` -> a quantization type for
    2-D tensors (default F32)."""
    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    model_type = c["model_type"]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[ARCH[model_type]]])
    write_metadata(w, c, model_type)
    tensors = {**converted_tensors(folder, c, model_type), **extra_tensors(c, model_type)}
    for name, t in tensors.items():
        array = t.float().numpy()
        qtype = quantize(name) if quantize and array.ndim == 2 else None
        if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------- checks
def prompt_logits(runner: ModelRunner) -> torch.Tensor:
    n = len(PROMPT)
    meta = AttentionMetadata.build([n], [n], [[0, 1]], torch.arange(n), 8)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(PROMPT), torch.arange(n), runner.pool.kv_caches, meta, runner.backend)
        return runner.model.compute_logits(hidden)


def runner_for(path, quantization: str = "none") -> ModelRunner:
    return ModelRunner(RuntimeConfig(num_kv_blocks=8, block_size=8, quantization=quantization), str(path))


def same_spec(a, b) -> None:
    """Equal specs; the norm epsilon went through fp32 metadata."""
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(a, rms_norm_eps=0.0) == dataclasses.replace(b, rms_norm_eps=0.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_loads_to_the_folders_weights_and_logits(case, tmp_path):
    model_type, overrides = CASES[case]
    folder = write_tiny_model(tmp_path / "hf", model_type, **overrides)
    path = to_gguf(folder, tmp_path / f"{case}.gguf")
    cpu = torch.device("cpu")
    ours, theirs = load_model(path, torch.float32, cpu), load_model(folder, torch.float32, cpu)
    same_spec(ours.spec, theirs.spec)
    assert type(ours) is type(theirs)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    torch.testing.assert_close(prompt_logits(runner_for(path)), prompt_logits(runner_for(folder)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["llama", "phi3"])
def test_quantized_gguf_serves_its_blocks_through_the_int4_path(case, tmp_path):
    """Q4_0 attention and Q4_1 MLP projections (F32 embeddings and norms), in a llama (q/k rows
    permuted) and a Phi-3 (q/k/v and gate/up fused): loaded dense it is the folder of its
    dequantized weights (un-permuted); ``auto`` serves it int4 with those very weights, close to
    the dense logits."""
    from safetensors.torch import load_file, save_file

    model_type, overrides = {"llama": ("llama", {}), "phi3": CASES["phi3-longrope"]}[case]
    folder = Path(write_tiny_model(tmp_path / "hf", model_type, **overrides))
    q4 = {"attn": gguf.GGMLQuantizationType.Q4_0, "ffn": gguf.GGMLQuantizationType.Q4_1}

    def kind(name):
        return q4.get(name.split(".")[2].split("_")[0]) if name.startswith("blk.") else None

    path = to_gguf(folder, tmp_path / "q4.gguf", kind)
    # the reference folder: each projection dequantized as llama.cpp would, then un-permuted
    c = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCH[model_type]], c["num_hidden_layers"])
    reader = gguf.GGUFReader(str(path))
    state = load_file(folder / "model.safetensors")
    for hf_name in list(state):
        t = next((t for t in reader.tensors if t.name == names.get_name(hf_name, try_suffixes=(".weight",))), None)
        if t is None or t.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        for proj, n_head in (("q_proj", c["num_attention_heads"]), ("k_proj", c["num_key_value_heads"])):
            if proj in hf_name and model_type == "llama":  # the inverse of permute: [head, i, half] -> [head, half, i]
                w = w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        assert w.shape == state[hf_name].shape and not torch.equal(w, state[hf_name])
        state[hf_name] = w
    reference = tmp_path / "dequantized"
    reference.mkdir()
    (reference / "config.json").write_text((folder / "config.json").read_text())
    save_file(state, reference / "model.safetensors")

    config, dense, method, quant = read_checkpoint(path)
    assert method == "int4" and set(quant) == {n for n in state if n.endswith("_proj.weight")}
    for name, w in quant.items():
        assert w.group_size == 32
        torch.testing.assert_close(w.dequantize(), state[name], rtol=0, atol=1e-6)  # the blocks, repacked
        assert torch.equal(dense[name], state[name])
    exact = prompt_logits(runner_for(reference))
    torch.testing.assert_close(prompt_logits(runner_for(path, "none")), exact, rtol=1e-5, atol=1e-5)
    int4 = runner_for(path, "auto")
    assert int4.model.quantization == "int4"
    got = prompt_logits(int4)
    # bf16 activations in the packed kernels: a few bf16 ulps of the logits' scale, on the top logits
    # (the int4 LM head recomputes its top 64 exactly; the tail of a 128-token vocabulary it does not)
    top = exact.topk(5, dim=-1)
    torch.testing.assert_close(got.gather(-1, top.indices), top.values, rtol=0, atol=3e-2 * exact.abs().max().item())
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "bloom.gguf"
    w = gguf.GGUFWriter(str(path), "bloom")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'bloom' is not supported"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_two_ranks_read_their_slices_of_a_mixtral_gguf(tmp_path):
    """Tensor parallel 2 from the GGUF (each rank its heads of the permuted q/k rows, its half of every
    expert's rows and columns, read from the stacked 3-D tensors): the tokens and logprobs of one
    rank on the folder."""
    from folio.core.executor.runtime.workers import ParallelRunner
    from tests.executor.test_model_families import PROMPTS, run

    model_type, overrides = CASES["mixtral"]
    folder = write_tiny_model(tmp_path / "hf", model_type, **overrides)
    path = str(to_gguf(folder, tmp_path / "mixtral.gguf"))
    failures: list[str] = []
    config = RuntimeConfig(model=path, device="cpu", dtype="float32", quantization="none", block_size=8,
                           num_kv_blocks=64, tensor_parallel_size=2)
    group = ParallelRunner(config, path, on_failure=failures.append)
    try:
        ours = run(group, PROMPTS[:2], budget=16)
    finally:
        group.close()
    assert not failures
    reference = run(runner_for(folder), PROMPTS[:2], budget=16)
    for (tokens, lps, _), (want, want_lps, _) in zip(ours, reference):
        assert tokens == want
        for lp, ref in zip(lps, want_lps):
            assert lp.top_token_ids == ref.top_token_ids
            assert lp.top_logprobs == pytest.approx(ref.top_logprobs, abs=1e-4)

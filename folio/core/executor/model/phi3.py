"""Phi-3 (and Phi-4, the same architecture): the Llama layer, read from a checkpoint whose q/k/v and
gate/up projections are already fused (``qkv_proj``: q rows, then k, then v; ``gate_up_proj``:
gate rows, then up). ``checkpoint_layout`` takes row ranges of the fused tensors, so under tensor
parallelism each rank reads only its heads' rows of q, k and v and its rows of gate and up.

LongRoPE (``rope_scaling`` type ``longrope``, formerly ``su``) comes from ``layers.rope_cos_sin``:
the short factors below ``original_max_position_embeddings``, the long ones from there on (its
docstring says how that compares with transformers). ``sliding_window`` applies to every layer.
A partial rotary factor (only part of each head rotated) is refused.
"""

from __future__ import annotations

from folio.core.executor.model.layers import CausalLM, ModelSpec, Part
from folio.core.executor.parallel.comm import Shard


class Phi3ForCausalLM(CausalLM):
    model_types = ("phi3",)
    architectures = ("Phi3ForCausalLM",)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"phi3 with partial_rotary_factor {params['partial_rotary_factor']} is not supported "
                             "(RoPE over whole heads only)")
        return ModelSpec.from_hf_config(config)

    @classmethod
    def checkpoint_layout(cls, spec: ModelSpec, shard: Shard = Shard()) -> dict[str, list[Part]]:
        layout = super().checkpoint_layout(spec, shard)  # the per-projection layout; fused names replace it
        hd, q_rows, kv_rows = spec.head_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        h0, h1 = shard.split(spec.num_heads, "the number of attention heads")
        kv0, kv1 = shard.kv_heads(spec.num_heads, spec.num_kv_heads)
        i0, i1 = shard.split(spec.intermediate_size, "the intermediate size")
        size = spec.intermediate_size
        for i in range(spec.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            qkv = src + "self_attn.qkv_proj.weight"  # [q_rows + 2 kv_rows, hidden]
            layout[dst + "self_attn.qkv_proj.weight"] = [
                (qkv, 0, h0 * hd, h1 * hd), (qkv, 0, q_rows + kv0 * hd, q_rows + kv1 * hd),
                (qkv, 0, q_rows + kv_rows + kv0 * hd, q_rows + kv_rows + kv1 * hd)]
            gate_up = src + "mlp.gate_up_proj.weight"  # [2 intermediate, hidden]
            layout[dst + "mlp.gate_up_proj.weight"] = [(gate_up, 0, i0, i1), (gate_up, 0, size + i0, size + i1)]
        return layout

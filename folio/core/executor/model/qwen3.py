"""Qwen3 (dense): the Llama layer with an RMSNorm over each head of q and of k before RoPE.

``Attention.norm_qkv`` applies the norms to the fused q/k/v output, so every backend's RoPE + KV
write (the torch reference, the CPU and the CUDA kernels) rotates the normed q and k. With
``use_sliding_window`` the layers from ``max_window_layers`` on are windowed, as in Qwen2.
"""

from __future__ import annotations

import dataclasses

from folio.core.executor.model.layers import CausalLM, ModelSpec


class Qwen3ForCausalLM(CausalLM):
    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        # q_norm/k_norm: [head_dim] each, shared by every head
        return dataclasses.replace(ModelSpec.from_hf_config(config), qk_norm="head")

"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with routed experts plus a shared
expert that every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from folio.core.executor.model.moe import MoECausalLM


class Qwen2MoeForCausalLM(MoECausalLM):
    model_types = ("qwen2_moe",)
    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def moe_options(cls, config) -> dict:
        return {"shared_expert_intermediate_size": config.shared_expert_intermediate_size,
                "qkv_bias": bool(getattr(config, "qkv_bias", True))}

"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with routed experts plus a shared
expert that every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from folio.core.executor.model.layers import ModelSpec
from folio.core.executor.model.moe import MoECausalLM, moe_spec


class Qwen2MoeForCausalLM(MoECausalLM):
    model_types = ("qwen2_moe",)
    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        return moe_spec(config, num_experts=config.num_experts, norm_topk_prob=bool(config.norm_topk_prob),
                        moe_intermediate_size=config.moe_intermediate_size,
                        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                        qkv_bias=bool(getattr(config, "qkv_bias", True)))

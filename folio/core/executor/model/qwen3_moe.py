"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with many small experts.

``norm_topk_prob`` says whether the top-k weights are renormalised; ``decoder_sparse_step`` and
``mlp_only_layers`` leave some layers dense (an MLP of ``intermediate_size``).
"""

from __future__ import annotations

from folio.core.executor.model.layers import ModelSpec
from folio.core.executor.model.moe import MoECausalLM, moe_spec


class Qwen3MoeForCausalLM(MoECausalLM):
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        return moe_spec(config, num_experts=config.num_experts, norm_topk_prob=bool(config.norm_topk_prob),
                        moe_intermediate_size=config.moe_intermediate_size, qk_norm="head")

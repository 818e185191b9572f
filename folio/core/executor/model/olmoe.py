"""OLMoE: RMSNorm over the whole q and k projections (not per head) before RoPE, optional
q/k/v clipping, and 64 experts top-8 (``intermediate_size`` is each expert's)."""

from __future__ import annotations

from folio.core.executor.model.layers import ModelSpec
from folio.core.executor.model.moe import MoECausalLM, moe_spec


class OlmoeForCausalLM(MoECausalLM):
    model_types = ("olmoe",)
    architectures = ("OlmoeForCausalLM",)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        return moe_spec(config, num_experts=config.num_experts, norm_topk_prob=bool(config.norm_topk_prob),
                        moe_intermediate_size=config.intermediate_size, qk_norm="full",
                        clip_qkv=getattr(config, "clip_qkv", None))

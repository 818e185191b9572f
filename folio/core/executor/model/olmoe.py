"""OLMoE: RMSNorm over the whole q and k projections (not per head) before RoPE, optional
q/k/v clipping, and 64 experts top-8 (``intermediate_size`` is each expert's)."""

from __future__ import annotations

from folio.core.executor.model.moe import MoECausalLM


class OlmoeForCausalLM(MoECausalLM):
    model_types = ("olmoe",)
    architectures = ("OlmoeForCausalLM",)

    qk_norm = "full"  # over all of q and k, not per head

    @classmethod
    def moe_options(cls, config) -> dict:
        return {"moe_intermediate_size": config.intermediate_size, "clip_qkv": getattr(config, "clip_qkv", None)}

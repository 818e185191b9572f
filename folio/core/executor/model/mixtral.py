"""Mixtral: the Mistral layer with a sparse MoE block (softmax, top-k, always renormalised).

The checkpoint names the block ``block_sparse_moe`` and an expert's projections w1 (gate),
w3 (up) and w2 (down); ``intermediate_size`` is each expert's.
"""

from __future__ import annotations

from folio.core.executor.model.layers import ModelSpec
from folio.core.executor.model.moe import MoECausalLM, moe_spec


class MixtralForCausalLM(MoECausalLM):
    model_types = ("mixtral",)
    architectures = ("MixtralForCausalLM",)
    ckpt_block = "block_sparse_moe"
    ckpt_expert_names = ("w1", "w3", "w2")

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        return moe_spec(config, num_experts=config.num_local_experts, norm_topk_prob=True,
                        moe_intermediate_size=config.intermediate_size)

"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with many small experts.

``norm_topk_prob`` says whether the top-k weights are renormalised; ``decoder_sparse_step`` and
``mlp_only_layers`` leave some layers dense (an MLP of ``intermediate_size``).
"""

from __future__ import annotations

from folio.core.executor.model.moe import MoECausalLM


class Qwen3MoeForCausalLM(MoECausalLM):
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    qk_norm = "head"  # per head, as Qwen3

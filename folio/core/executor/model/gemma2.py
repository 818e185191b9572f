"""Gemma 2: the Llama layer with Gemma's changes, each a ``ModelSpec`` field the shared layers read.

- RMSNorm scales by ``(1 + w)``: ``norm_offset`` 1, folded into the weights as they load
  (``layers.RMSNorm``), so the norms run as plain RMSNorm;
- norms after attention and around the MLP (``sandwich_norms``): input -> attention ->
  post_attention_layernorm -> + residual -> pre_feedforward_layernorm -> MLP ->
  post_feedforward_layernorm -> + residual;
- the embeddings times ``sqrt(hidden_size)``; a GeGLU MLP (tanh-approximated GELU);
- the attention scale ``query_pre_attn_scalar ** -0.5``, scores soft-capped by
  ``attn_logit_softcapping``, the final logits by ``final_logit_softcapping``;
- a sliding window on the layers ``layer_types`` calls ``sliding_attention`` (every other one).
"""

from __future__ import annotations

import dataclasses

from folio.core.executor.model.layers import CausalLM, ModelSpec


def gemma_spec(config, **extras) -> ModelSpec:
    """The spec fields Gemma 2 and 3 share."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type} with use_bidirectional_attention (an encoder) is not supported")
    if getattr(config, "attention_bias", False):  # Gemma's would include o_proj's bias, which the layer lacks
        raise ValueError(f"{config.model_type} with attention_bias is not supported")
    return dataclasses.replace(
        ModelSpec.from_hf_config(config), norm_offset=1.0, sandwich_norms=True,
        embed_scale=config.hidden_size**0.5, query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        attn_softcap=float(config.attn_logit_softcapping or 0.0),
        final_softcap=float(config.final_logit_softcapping or 0.0), **extras)


class Gemma2ForCausalLM(CausalLM):
    model_types = ("gemma2",)
    architectures = ("Gemma2ForCausalLM",)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        return gemma_spec(config)

"""Gemma 3's vision-language model (``Gemma3ForConditionalGeneration``): a SigLIP vision tower and
Gemma 3's projector over the Gemma 3 text model.

The text model is folio's own Gemma 3 decoder (``gemma3.py``: its local layers' window and second
RoPE table, the embedding scale), over the checkpoint's text config; the vision tower (SigLIP's,
``AutoModel.from_config(config.vision_config)`` as transformers builds it) and
``Gemma3MultiModalProjector`` (average pooling to ``mm_tokens_per_image`` rows, a norm and one
projection) are transformers' own modules, loaded from the same checkpoint. Each image's rows
replace its ``<image_soft_token>`` placeholders' embeddings after the embedding scale, as
transformers does. An image's placeholders attend each other both ways
(``images_attend_both_ways``: ``AttentionMetadata.image_spans``, docs/serving-api.md), so a step
holds an image's placeholders whole. Checkpoints name the text model ``language_model.model.``
(transformers' saved layout) or ``model.language_model.`` (its in-memory one); both read as the
plain ``model.``. The head is tied to the embeddings unless the config says not.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from folio.core.executor.model.gemma3 import Gemma3ForCausalLM
from folio.core.executor.model.layers import ModelSpec
from folio.core.executor.model.vision_lm import VisionLanguageLM

# checkpoint prefixes -> the names the text layout and ``vision`` read
# (transformers saves the first two and ``vision_tower.``; older checkpoints nest the tower's ``vision_model.``)
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."), ("model.vision_tower.vision_model.", "vision_tower."),
            ("vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))


class Gemma3Vision(nn.Module):
    """The tower and projector, as ``Gemma3Model`` holds them (so the checkpoint's names fit)."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [images, 3, H, W] -> [images, tokens, hidden]
        hidden = self.vision_tower(pixel_values=pixel_values, return_dict=True).last_hidden_state
        return self.multi_modal_projector(hidden)


class Gemma3ForConditionalGeneration(VisionLanguageLM, Gemma3ForCausalLM):
    """``VisionLanguageLM`` over ``Gemma3ForCausalLM`` (whose ``init_rope`` builds the local table)."""

    model_types = ("gemma3",)
    architectures = ("Gemma3ForConditionalGeneration",)
    vision_class = Gemma3Vision
    renames = _RENAMES
    images_attend_both_ways = True

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        spec = Gemma3ForCausalLM.spec_from_config(config.text_config)
        # the composite config's own setting ties the head (as transformers' ``tie_weights`` reads it)
        tied = bool(getattr(config, "tie_word_embeddings", spec.tie_word_embeddings))
        return dataclasses.replace(spec, model_type=cls.model_types[0], tie_word_embeddings=tied)

    @property
    def image_length(self) -> int:
        """Placeholders per image (``mm_tokens_per_image``): a step's token budget must hold them."""
        return int(self.mm_config.mm_tokens_per_image)

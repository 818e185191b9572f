"""LLaVA (``LlavaForConditionalGeneration``): a vision tower and a projector over a Llama text model.

The text model is folio's own Llama decoder (``llama.py``, the paged pool and every backend); the
vision tower (CLIP's, ``AutoModel.from_config(config.vision_config)`` as transformers builds it)
and the two-layer ``LlavaMultiModalProjector`` are transformers' own modules, loaded from the same
checkpoint. ``encode_images`` runs them: the tower's hidden states at ``vision_feature_layer``,
the CLS position dropped for the ``default`` feature selection, then the projector; the runner
puts each image's rows in place of its placeholder tokens' embeddings (``CausalLM.forward``'s
``embeds``). Checkpoints name the text model ``language_model.model.`` (transformers' saved
layout) or ``model.language_model.`` (its in-memory one); both read as the plain ``model.``.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.core.executor.model.vision_lm import VisionLanguageLM

# checkpoint prefixes -> the names the text layout and ``vision`` read
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."))


class LlavaVision(nn.Module):
    """The tower and projector, as ``LlavaModel`` holds them (so the checkpoint's names fit)."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [images, 3, H, W] -> [images, tokens, hidden]
        layer = self.config.vision_feature_layer
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = [layer] if isinstance(layer, int) else list(layer)
        feats = [out.hidden_states[i] for i in layers]
        if self.config.vision_feature_select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        return self.multi_modal_projector(torch.cat(feats, dim=-1))


class LlavaForConditionalGeneration(VisionLanguageLM):
    model_types = ("llava",)
    architectures = ("LlavaForConditionalGeneration",)
    vision_class = LlavaVision
    renames = _RENAMES

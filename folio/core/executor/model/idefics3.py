"""Idefics3 (``Idefics3ForConditionalGeneration``, SmolVLM's architecture): a SigLIP-style vision
tower and a pixel-shuffle connector over a Llama text model.

The text model is folio's own Llama decoder (``llama.py``, the paged pool and every backend); the
vision tower (``Idefics3VisionTransformer``) and the connector (``Idefics3Connector``: pixel
shuffle, then one projection) are transformers' own modules, loaded from the same checkpoint, as
``llava.py`` does for LLaVA. ``encode_images`` runs them on whole tiles (the processor resizes
each image, or each tile of a split image, to the tower's square, so no pixel is padding): the
tower's last hidden state, then the connector, one row per ``<image>`` placeholder of the tile
(``(image_size / patch_size / scale_factor) ** 2``). The ``<fake_token_around_image>``,
``<global-img>`` and ``<row_i_col_j>`` tokens around them are ordinary text tokens. Checkpoints
name the text model ``model.text_model.``; it reads as the plain ``model.``.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.core.executor.model.vision_lm import VisionLanguageLM

# checkpoint prefixes -> the names the text layout and ``vision`` read
_RENAMES = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
            ("model.connector.", "connector."))


class Idefics3Vision(nn.Module):
    """The tower and connector, as ``Idefics3Model`` holds them (so the checkpoint's names fit)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        self.vision_model = Idefics3VisionTransformer._from_config(config.vision_config)
        self.connector = Idefics3Connector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [tiles, 3, H, W] -> [tiles, tokens, hidden]
        # every patch is real (no padded pixels): the tower's all-ones patch mask, as transformers
        # builds it from an all-ones pixel mask
        hidden = self.vision_model(pixel_values=pixel_values, return_dict=True).last_hidden_state
        return self.connector(hidden)


class Idefics3ForConditionalGeneration(VisionLanguageLM):
    model_types = ("idefics3",)
    architectures = ("Idefics3ForConditionalGeneration",)
    vision_class = Idefics3Vision
    renames = _RENAMES

"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a windowed ViT that reads each image at its
own size, a patch merger, and a Qwen2 text model rotated by M-RoPE.

The text model is folio's own Llama decoder with Qwen2's q/k/v biases (the paged pool and every
backend); the vision module is transformers' own ``Qwen2_5_VisionTransformerPretrainedModel``,
loaded from the same checkpoint (``visual.``, or ``model.visual.`` in transformers 5's layout;
the text model ``model.`` or ``model.language_model.``; ``lm_head.`` absent when tied).
``encode_images`` runs it on images of one grid together (each image's flattened patches and its
``(t, h, w)`` patch grid, as ``get_image_features`` does), one row per placeholder after the
merger (``t * h * w / merge_size ** 2``).

M-RoPE: each head dimension's rotation is taken from one of three positions (temporal, height,
width; ``mrope_section`` says which dimensions go with which). A text token has all three equal,
so it rotates as plain RoPE, at its index plus its request's delta (``runtime/mrope.py``); an
image token's three differ, and its cos/sin row is built from the three positions' rows of the
plain table (``mrope_rows``) into a tail of the tables that ``reserve_rope_rows`` appends, which
its position then indexes: every backend reads the tables by position as for any model.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from folio.core.executor.model.layers import ModelSpec
from folio.core.executor.model.vision_lm import VisionLanguageLM
from folio.core.executor.parallel.comm import Comm, Shard

# checkpoint prefixes -> the names the text layout and ``vision`` read (transformers 5 saves the
# hub's layout: ``model.`` and ``visual.``, which stay)
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen25VLVision(nn.Module):
    """The vision transformer and its merger, as ``Qwen2_5_VLModel`` holds them (``visual.``)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[images, patches, features] of images of one grid -> [images, tokens, hidden]."""
        n, patches, features = pixel_values.shape
        out = self.visual(pixel_values.reshape(n * patches, features), grid_thw=grid_thw, return_dict=True)
        return out.pooler_output.reshape(n, -1, out.pooler_output.shape[-1])


class Qwen25VLForConditionalGeneration(VisionLanguageLM):
    model_types = ("qwen2_5_vl",)
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    vision_class = Qwen25VLVision
    renames = _RENAMES

    def __init__(self, spec: ModelSpec, hf_config, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__(spec, hf_config, shard, comm)
        params = getattr(hf_config.text_config, "rope_parameters", None) or {}
        section = list(params.get("mrope_section") or ())
        if len(section) != 3 or sum(section) * 2 != spec.head_dim:
            raise ValueError(f"qwen2_5_vl: mrope_section {section} does not split head_dim {spec.head_dim} in three")
        # each dimension's source among (temporal, height, width), over both halves of the head
        self.mrope_sources = tuple(i for i, n in enumerate(section) for _ in range(n)) * 2
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.rope_extra_rows = 0  # rows after the plain table, for a step's image tokens

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        spec = super().spec_from_config(config)
        tied = bool(getattr(config, "tie_word_embeddings", False)) or spec.tie_word_embeddings
        return dataclasses.replace(spec, qkv_bias=True, tie_word_embeddings=tied)  # Qwen2's q/k/v biases

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """``[images, patches, features]`` of images of one ``grid_thw`` (``[images, 3]``) ->
        ``[images, placeholders, hidden]`` in the decoder's dtype."""
        if grid_thw is None:
            raise ValueError("qwen2_5_vl: an image without its patch grid (image_grid_thw)")
        dtype = next(self.vision.parameters()).dtype
        out = self.vision(pixel_values.to(dtype), grid_thw.to(pixel_values.device))
        return out.to(self.embed_tokens.weight.dtype)

    def reserve_rope_rows(self, rows: int) -> None:
        """``rows`` rows after the plain tables, where each step's image tokens get theirs
        (made once, at start: the tables' addresses stay for the kernels and graphs that hold them)."""
        base = self.rope_cos.shape[0] - self.rope_extra_rows
        pad = self.rope_cos.new_zeros((rows, self.rope_cos.shape[1]))
        self.rope_cos = torch.cat([self.rope_cos[:base], pad])
        self.rope_sin = torch.cat([self.rope_sin[:base], pad.clone()])
        self.rope_extra_rows = rows

    def mrope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Writes the cos/sin rows of tokens at (temporal, height, width) ``positions`` ([n, 3]
        int64, each below the plain table's rows) into the tail; their row indices ([n])."""
        n, base = positions.shape[0], self.rope_cos.shape[0] - self.rope_extra_rows
        if n > self.rope_extra_rows:
            raise ValueError(f"a step with {n} image tokens; the RoPE tables keep rows for {self.rope_extra_rows}")
        device = self.rope_cos.device
        sources = positions.to(device)[:, torch.tensor(self.mrope_sources, device=device)]  # [n, head_dim]
        dims = torch.arange(self.rope_cos.shape[1], device=device)
        self.rope_cos[base:base + n] = self.rope_cos[sources, dims]
        self.rope_sin[base:base + n] = self.rope_sin[sources, dims]
        return torch.arange(base, base + n, device=device)

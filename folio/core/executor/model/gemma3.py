"""Gemma 3 (text): Gemma 2's layer (``gemma2.py``) with per-head q/k norms (``(1 + w)`` as every
Gemma norm) and no soft-capping by default; five sliding-window (local) layers to one global
(``layer_types``), the local ones rotated by their own RoPE base (``rope_local_base_freq``, in
transformers 5 the ``sliding_attention`` entry of ``rope_parameters``): ``init_rope`` builds the
second table and ``CausalLM.forward`` hands it to the windowed layers.

The multimodal checkpoint, ``Gemma3ForConditionalGeneration``, runs this decoder over its text
config with the SigLIP tower for images (``gemma3_vlm.py``).
"""

from __future__ import annotations

import torch

from folio.core.executor.model.gemma2 import gemma_spec
from folio.core.executor.model.layers import CausalLM, ModelSpec, RopeTables, rope_cos_sin


class Gemma3ForCausalLM(CausalLM):
    model_types = ("gemma3_text",)
    architectures = ("Gemma3ForCausalLM",)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        if "sliding_attention" in config.layer_types and not config.sliding_window:  # (the local RoPE table
            raise ValueError("gemma3_text with local layers but no sliding_window is not supported")  # goes by window)
        return gemma_spec(config, qk_norm="head")  # q_norm/k_norm: [head_dim] each, shared by every head

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        n = self.spec.max_position_embeddings
        cos, sin = rope_cos_sin(self.hf_config, n, dtype, "full_attention")  # [n, head_dim] each
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        cos, sin = rope_cos_sin(self.hf_config, n, dtype, "sliding_attention")
        self.local_rope = RopeTables(cos.to(device), sin.to(device))

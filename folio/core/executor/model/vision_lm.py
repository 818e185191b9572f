"""What a vision-language family shares: folio's own text decoder over the checkpoint's text config,
a vision module (transformers' tower and projector, loaded from the same checkpoint under
``vision.``) and ``encode_images``. A family names its ``model_types``, its ``vision_class`` and
the checkpoint prefixes it ``renames`` (``llava.py``, ``idefics3.py``)."""

from __future__ import annotations

import dataclasses

import torch

from folio.core.executor.model.layers import CausalLM, ModelSpec, Part
from folio.core.executor.parallel.comm import Comm, Shard


class VisionLanguageLM(CausalLM):
    vision_class: type  # the tower and projector, as the checkpoint names them
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint prefixes -> the names the text layout and ``vision`` read
    # an image's placeholders attend each other both ways (Gemma 3): the step's ``image_spans``
    images_attend_both_ways = False

    def __init__(self, spec: ModelSpec, hf_config, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__(spec, hf_config.text_config, shard, comm)  # the decoder reads the text config
        self.mm_config = hf_config
        self.image_token_id = int(hf_config.image_token_id)
        with torch.device("cpu"):  # built for real: the tower has buffers that no checkpoint holds
            self.vision = self.vision_class(hf_config)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        return dataclasses.replace(ModelSpec.from_hf_config(config.text_config), model_type=cls.model_types[0])

    @classmethod
    def checkpoint_state(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in state.items():
            for old, new in cls.renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[name] = tensor
        return out

    def extra_layout(self) -> dict[str, list[Part]]:
        return {f"vision.{name}": [(name, None, 0, 0)] for name in self.vision.state_dict()}

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Each image's (tile's) placeholder embeddings, ``[images, tokens, hidden]`` in the decoder's dtype."""
        dtype = next(self.vision.parameters()).dtype
        return self.vision(pixel_values.to(dtype)).to(self.embed_tokens.weight.dtype)

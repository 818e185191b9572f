"""Images in, on the tokenizer's side: a prompt's images through its model's own processor.

The model folder's processor (``AutoProcessor``: for LLaVA a ``LlavaProcessor`` over a
``CLIPImageProcessor``) resizes and normalises each image and expands each image token of the
prompt text into the placeholders the vision tower's output fills, as transformers does; no
resizing or normalising is written here. What leaves for the engine is an ``ImageInput`` per
image: its placeholder positions, the sha256 of its pixel values (the prefix cache's key), and
the pixel values as raw little-endian bytes with their dtype and shape.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np

from folio.shared.messages import ImageInput


class ImageError(ValueError):
    """An image the processor cannot take (``RequestError`` carries it to the client as a 400)."""


def decode_image(data: bytes, index: int):
    """A PIL image from an encoded image file's bytes, fully read (ImageError when it is not one)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"image {index} is not an image that can be read (PNG, JPEG, GIF, WebP ...): {exc}") from None
    return image


class ImagePreprocessor:
    """The processor of a model folder whose config has a vision tower (``vision_config``)."""

    def __init__(self, model_dir: str | Path, model_config: dict):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        token_id = model_config.get("image_token_id", model_config.get("image_token_index"))
        if token_id is None:
            raise ValueError(f"{model_dir}: the config names no image token (image_token_id)")
        self.image_token_id = int(token_id)

    def process(self, text: str, images: list[bytes], add_special_tokens: bool) -> tuple[list[int], list[ImageInput]]:
        """(prompt token ids with every image's placeholders, the images) of ``text``, which names
        each image with the model's image token (the chat template writes it for an image part)."""
        pil = [decode_image(data, i) for i, data in enumerate(images)]
        try:
            out = self.processor(text=text, images=pil, add_special_tokens=add_special_tokens, return_tensors="np")
        except (ValueError, TypeError, OSError) as exc:
            raise ImageError(f"the model's processor refused the images: {exc}") from None
        ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.ascontiguousarray(out["pixel_values"])
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        if len(pil) == 0 or len(positions) % len(pil) or len(pixels) != len(pil):
            raise ImageError(f"the prompt has {len(positions)} image placeholders for {len(pil)} images")
        length = len(positions) // len(pil)
        inputs = []
        for i in range(len(pil)):
            run = positions[i * length:(i + 1) * length]
            if run[-1] - run[0] != length - 1:
                raise ImageError(f"image {i}'s placeholders are not contiguous in the prompt")
            values = pixels[i].astype(pixels.dtype.newbyteorder("<"), copy=False)
            data = values.tobytes()
            digest = hashlib.sha256(f"{values.dtype.name}{list(values.shape)}".encode() + data).hexdigest()
            inputs.append(ImageInput(offset=int(run[0]), length=length, hash=digest, dtype=values.dtype.name,
                                     shape=list(values.shape), data=data))
        return ids, inputs

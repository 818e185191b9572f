"""Images in, on the tokenizer's side: a prompt's images through its model's own processor.

The model folder's processor (``AutoProcessor``: for LLaVA a ``LlavaProcessor`` over a
``CLIPImageProcessor``, for Idefics3 an ``Idefics3Processor``, for Gemma 3 a ``Gemma3Processor``) resizes and normalises each image
and expands each image token of the prompt text into the placeholders the vision tower's output
fills, as transformers does; no resizing or normalising is written here. What leaves for the
engine is an ``ImageInput`` per tile the tower reads (an image, or each tile of an image that
Idefics3's ``do_image_splitting`` cuts up, its whole image included): its placeholder positions
(one contiguous run; every tile has as many), the sha256 of its pixel values (the prefix cache's
key), the pixel values as raw little-endian bytes with their dtype and shape, and for Gemma 3
(``BOTH_WAYS_MODEL_TYPES``) the mark that its placeholders attend each other both ways.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np

from folio.shared.messages import ImageInput


# families whose image placeholders attend each other both ways (the executor's
# ``images_attend_both_ways``): the scheduler keeps each image's placeholders in one step
BOTH_WAYS_MODEL_TYPES = ("gemma3",)


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
        self.both_ways = model_config.get("model_type") in BOTH_WAYS_MODEL_TYPES

    def process(self, text: str, images: list[bytes], add_special_tokens: bool) -> tuple[list[int], list[ImageInput]]:
        """(prompt token ids with every image's placeholders, the images) of ``text``, which names
        each image with the model's image token (the chat template writes it for an image part)."""
        pil = [decode_image(data, i) for i, data in enumerate(images)]
        try:
            out = self.processor(text=text, images=pil, add_special_tokens=add_special_tokens, return_tensors="np")
        except (ValueError, TypeError, OSError) as exc:
            raise ImageError(f"the model's processor refused the images: {exc}") from None
        ids = [int(t) for t in out["input_ids"][0]]
        tiles = pixel_tiles(out, len(pil))
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        if len(pil) == 0 or len(positions) == 0 or len(positions) % len(tiles):
            raise ImageError(f"the prompt has {len(positions)} image placeholders for {len(pil)} images")
        length = len(positions) // len(tiles)
        inputs = []
        for i in range(len(tiles)):
            run = positions[i * length:(i + 1) * length]
            if run[-1] - run[0] != length - 1:
                raise ImageError(f"image tile {i}'s placeholders are not contiguous in the prompt")
            values = tiles[i].astype(tiles.dtype.newbyteorder("<"), copy=False)
            data = values.tobytes()
            digest = hashlib.sha256(f"{values.dtype.name}{list(values.shape)}".encode() + data).hexdigest()
            inputs.append(ImageInput(offset=int(run[0]), length=length, hash=digest, dtype=values.dtype.name,
                                     shape=list(values.shape), data=data, both_ways=self.both_ways))
        return ids, inputs


def pixel_tiles(out, num_images: int) -> np.ndarray:
    """The processor's pixel values as ``[tiles, channels, height, width]``: LLaVA's one per image;
    Idefics3's ``[1, tiles, ...]`` for the one prompt (an image split by ``do_image_splitting``
    gives several), whose pixel mask must be whole: a padded tile is not one the tower reads here."""
    pixels = np.asarray(out["pixel_values"])
    if pixels.ndim == 5:
        pixels = pixels[0]
        mask = out.get("pixel_attention_mask")
        if mask is not None and not np.asarray(mask).all():
            raise ImageError("the processor padded an image tile (its pixel mask is not whole); "
                             "padded tiles are not supported")
    elif len(pixels) != num_images:
        raise ImageError(f"the processor gave pixel values for {len(pixels)} images, not {num_images}")
    return np.ascontiguousarray(pixels)

"""Images in, on the tokenizer's side: a prompt's images through its model's own processor.

The model folder's processor (``AutoProcessor``: for LLaVA a ``LlavaProcessor`` over a
``CLIPImageProcessor``, for Idefics3 an ``Idefics3Processor``, for Qwen2.5-VL a
``Qwen2_5_VLProcessor``, built without its video half where torchvision is missing, for Gemma 3 a
``Gemma3Processor``) resizes and normalises each image
and expands each image token of the prompt text into the placeholders the vision tower's output
fills, as transformers does; no resizing or normalising is written here. What leaves for the
engine is an ``ImageInput`` per tile the tower reads (an image, or each tile of an image that
Idefics3's ``do_image_splitting`` cuts up, its whole image included): its placeholder positions
(one contiguous run; every tile has as many, except where the processor gives each image's patch
grid, Qwen2.5-VL's: an image of its own size, its own patches and count), the sha256 of its pixel
values (the prefix cache's key), the pixel values as raw little-endian bytes with their dtype
and shape, and for Gemma 3 (``BOTH_WAYS_MODEL_TYPES``) the mark that its placeholders attend
each other both ways.
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


def load_processor(model_dir: str | Path):
    """The folder's ``AutoProcessor``; where that fails only for want of its video half
    (Qwen2.5-VL's ``Qwen2VLVideoProcessor`` needs torchvision, and a folder may hold no video
    processor), the same processor class over the folder's image processor and tokenizer, with no
    video processor: images do not need one."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except (ImportError, OSError):
        processor_class = _processor_class(model_dir)
        if processor_class is None or "video_processor" not in processor_class.get_attributes():
            raise
        return _images_only_processor(model_dir, processor_class)


def _processor_class(model_dir: str | Path):
    """The transformers class the folder's processor files name (transformers 5's
    ``processor_config.json``, the older ``preprocessor_config.json``), or None."""
    import json

    import transformers

    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            found = getattr(transformers, json.loads(path.read_text()).get("processor_class") or "", None)
            if found is not None:
                return found
    return None


def _images_only_processor(model_dir: str | Path, processor_class):
    from transformers import AutoImageProcessor, AutoTokenizer

    class ImagesOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None and argument_name == "video_processor" else \
                super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return ImagesOnly(image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=tokenizer,
                      video_processor=None, chat_template=tokenizer.chat_template)


class ImagePreprocessor:
    """The processor of a model folder whose config has a vision tower (``vision_config``)."""

    def __init__(self, model_dir: str | Path, model_config: dict):
        self.processor = load_processor(model_dir)
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
        tiles, grids, lengths = self.tiles(out, len(pil))
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        if lengths is None and len(tiles) and len(positions) % len(tiles) == 0:
            lengths = [len(positions) // len(tiles)] * len(tiles)  # every tile has as many
        if len(pil) == 0 or len(positions) == 0 or lengths is None or sum(lengths) != len(positions):
            raise ImageError(f"the prompt has {len(positions)} image placeholders for {len(pil)} images")
        inputs, start = [], 0
        for i, (values, length) in enumerate(zip(tiles, lengths)):
            run = positions[start:start + length]
            start += length
            if run[-1] - run[0] != length - 1:
                raise ImageError(f"image tile {i}'s placeholders are not contiguous in the prompt")
            values = np.ascontiguousarray(values.astype(values.dtype.newbyteorder("<"), copy=False))
            data, grid = values.tobytes(), grids[i] if grids else []
            digest = hashlib.sha256(f"{values.dtype.name}{list(values.shape)}{grid or ''}".encode() + data).hexdigest()
            inputs.append(ImageInput(offset=int(run[0]), length=length, hash=digest, dtype=values.dtype.name,
                                     shape=list(values.shape), data=data, grid=grid, both_ways=self.both_ways))
        return ids, inputs

    def tiles(self, out, num_images: int) -> tuple[list[np.ndarray], list[list[int]], list[int] | None]:
        """(each tile's pixel values, each image's patch grid or none, each tile's placeholder
        count, None where every tile has as many). A processor that gives ``image_grid_thw``
        (Qwen2.5-VL's) flattens every image's patches into one ``[patches, features]`` array: an
        image is its ``t * h * w`` rows, and ``t * h * w / merge_size ** 2`` placeholders."""
        if "image_grid_thw" not in out:
            return list(pixel_tiles(out, num_images)), [], None
        grids = np.asarray(out["image_grid_thw"]).reshape(-1, 3).astype(np.int64)
        pixels = np.asarray(out["pixel_values"])
        sizes = grids.prod(axis=1)
        if len(grids) != num_images or pixels.ndim != 2 or sizes.sum() != len(pixels):
            raise ImageError(f"the processor gave {len(grids)} image grids and {len(pixels)} patches "
                             f"for {num_images} images")
        merge = int(self.processor.image_processor.merge_size)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        tiles = [pixels[bounds[i]:bounds[i + 1]] for i in range(len(grids))]
        return tiles, [[int(x) for x in g] for g in grids], [int(n) // merge ** 2 for n in sizes]


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

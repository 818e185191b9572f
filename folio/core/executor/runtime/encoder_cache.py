"""Images in: the vision tower's output in place of a prompt's image placeholders.

A request's images (``ImageInput``: pixel values as raw little-endian bytes, the placeholder
positions they fill) arrive with it in the plan. The tower runs on an image in the step whose
chunk first reaches one of its placeholders, never before, and its output (one row per
placeholder) is kept in this request's entry of the encoder-output cache, so a later chunk of the
same prefill that covers the rest of its placeholders reads the kept rows instead of running the
tower again. The entry goes when the request is dropped (finished, aborted, or preempted by
recompute: a recompute runs the tower again). Images may differ in size and placeholder count
(Qwen2.5-VL's: each its own patch grid); those of one shape and grid run together. Each step's
rows go to ``CausalLM.forward`` as ``embeds`` (their indices in the step's flattened tokens and
their values).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from folio.shared.messages import ImageInput


class ImageInputs:
    """The held requests' images and the encoder-output cache (per request, per image)."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.device = device
        self.images: dict[str, list[ImageInput]] = {}
        self.encoded: dict[str, dict[int, torch.Tensor]] = {}
        self.num_encoded = 0  # images the tower ran on (a test and a metric read it)
        self.num_image_tokens = 0  # placeholder rows it produced
        self.encoder_seconds = 0.0  # time in the tower and projector

    def add(self, req_id: str, images: list[ImageInput]) -> None:
        if not images:
            return
        if not hasattr(self.model, "encode_images"):
            raise ValueError("this model takes no images (it is a text-only model)")
        self.images[req_id] = list(images)
        self.encoded.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        self.images.pop(req_id, None)
        self.encoded.pop(req_id, None)

    def step_embeds(self, req_ids: list[str], starts: np.ndarray,
                    counts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, values) of the step's placeholder tokens: request ``req_ids[i]`` computes
        positions ``[starts[i], starts[i] + counts[i])``, its tokens after those of the ones
        before it. None when no scheduled chunk holds a placeholder."""
        if not self.images:
            return None
        wanted: list[tuple[str, int, int, int, int]] = []  # (req_id, image, first, last, row of first)
        token_start = 0
        for req_id, start, count in zip(req_ids, starts.tolist(), counts.tolist()):
            for k, im in enumerate(self.images.get(req_id, ())):
                lo, hi = max(start, im.offset), min(start + count, im.offset + im.length)
                if lo < hi:
                    wanted.append((req_id, k, lo - im.offset, hi - im.offset, token_start + lo - start))
            token_start += count
        if not wanted:
            return None
        self._encode_missing({(r, k) for r, k, *_ in wanted})
        rows = torch.cat([torch.arange(row, row + last - first) for _, _, first, last, row in wanted])
        values = torch.cat([self.encoded[r][k][first:last] for r, k, first, last, _ in wanted])
        return rows.to(self.device), values

    def step_spans(self, req_ids: list[str], starts: np.ndarray,
                   counts: np.ndarray) -> dict[int, list[tuple[int, int]]] | None:
        """``AttentionMetadata.image_spans``: for the i-th scheduled request, the [first, end)
        placeholder positions of each of its images that its chunk ``[starts[i], starts[i] + counts[i])``
        reaches. None when no chunk reaches one."""
        spans: dict[int, list[tuple[int, int]]] = {}
        if self.images:
            for i, (req_id, start, count) in enumerate(zip(req_ids, starts.tolist(), counts.tolist())):
                for im in self.images.get(req_id, ()):
                    if im.offset < start + count and start < im.offset + im.length:
                        spans.setdefault(i, []).append((im.offset, im.offset + im.length))
        return spans or None

    def _encode_missing(self, needed: set[tuple[str, int]]) -> None:
        """Run the tower on the needed images that it has not run on, those of one shape (and
        patch grid, where the tower reads images of any size) together."""
        missing = sorted(key for key in needed if key[1] not in self.encoded.get(key[0], {}))
        by_shape: dict[tuple, list[tuple[str, int]]] = {}
        for r, k in missing:
            im = self.images[r][k]
            by_shape.setdefault((im.dtype, tuple(im.shape), tuple(im.grid)), []).append((r, k))
        for (dtype, shape, grid), keys in by_shape.items():
            pixels = torch.from_numpy(np.stack([pixel_array(self.images[r][k]) for r, k in keys])).to(self.device)
            start = time.perf_counter()
            # [images, tokens, hidden]
            out = self.model.encode_images(pixels, torch.tensor([grid] * len(keys))) if grid \
                else self.model.encode_images(pixels)
            self.encoder_seconds += time.perf_counter() - start
            for (r, k), rows in zip(keys, out):
                length = self.images[r][k].length
                if rows.shape[0] != length:
                    raise ValueError(f"image {k} of {r}: the vision tower gave {rows.shape[0]} rows for "
                                     f"{length} placeholders")
                self.encoded.setdefault(r, {})[k] = rows
                self.num_image_tokens += length
            self.num_encoded += len(keys)

    def stats(self) -> dict:
        return {"num_images_encoded": self.num_encoded, "num_image_tokens_encoded": self.num_image_tokens,
                "encoder_seconds_total": round(self.encoder_seconds, 6)}


def pixel_array(im: ImageInput) -> np.ndarray:
    """An image's pixel values from their little-endian bytes (checked against dtype and shape)."""
    dtype = np.dtype(im.dtype).newbyteorder("<")
    expected = int(np.prod(im.shape)) * dtype.itemsize
    if len(im.data) != expected:
        raise ValueError(f"image pixel data of {len(im.data)} bytes for shape {im.shape} of {im.dtype}")
    return np.frombuffer(im.data, dtype=dtype).reshape(im.shape).astype(dtype.newbyteorder("="))

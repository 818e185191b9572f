"""M-RoPE positions (Qwen2.5-VL), derived from a request's prompt and images alone.

transformers' ``get_rope_index``: text tokens count on from the position after what came before
(all three of temporal, height and width equal); an image's placeholders, a ``t x h x w`` grid
after the merger, sit at ``start + (t_i, h_i, w_i)`` with ``start`` the position its first
placeholder would have had as text, and the text after it goes on from ``start + max(h, w)``. So
a text token's position is its index plus the delta of the images before it, and every token
after the prompt (the decodes) is at its index plus the request's whole delta, ``rope_deltas``.
Nothing here depends on which steps computed what: a recompute after preemption, a prefix-cache
hit and a chunked prefill give each token the same position.

``MRopePositions`` holds the requests' image layouts and rewrites a step's positions: text tokens
to their index plus delta, image tokens to rows of the RoPE tables' tail that the model fills for
the step from their three positions (``Qwen25VLForConditionalGeneration.mrope_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.shared.messages import ImageInput


@dataclass(frozen=True)
class ImageLayout:
    """A request's images in prompt order: where their placeholders are and their grids."""

    offsets: np.ndarray  # [k] first placeholder's index
    ends: np.ndarray  # [k] one past the last
    grids: np.ndarray  # [k, 3] (t, h, w) after the merger
    starts: np.ndarray  # [k] the position of each image's grid origin
    deltas: np.ndarray  # [k + 1] position minus index of text after 0, 1, ..., k images

    @staticmethod
    def of(images: list[ImageInput], merge: int) -> ImageLayout:
        images = sorted(images, key=lambda im: im.offset)
        offsets, ends, grids, starts, deltas = [], [], [], [], [0]
        for im in images:
            grid = (im.grid[0], im.grid[1] // merge, im.grid[2] // merge) if len(im.grid) == 3 else ()
            if not grid or grid[0] * grid[1] * grid[2] != im.length:
                raise ValueError(f"an image of patch grid {im.grid} (merged by {merge}) for {im.length} placeholders")
            offsets.append(im.offset)
            ends.append(im.offset + im.length)
            grids.append(grid)
            starts.append(im.offset + deltas[-1])
            deltas.append(deltas[-1] + max(grid[1], grid[2]) - im.length)
        return ImageLayout(np.array(offsets, dtype=np.int64), np.array(ends, dtype=np.int64),
                           np.array(grids, dtype=np.int64).reshape(-1, 3), np.array(starts, dtype=np.int64),
                           np.array(deltas, dtype=np.int64))

    @property
    def rope_delta(self) -> int:
        """Position minus index of every token after the last image (transformers' ``rope_deltas``)."""
        return int(self.deltas[-1])

    def positions(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(``[3, n]`` temporal, height and width positions of the tokens at ``index``, which of
        them are placeholders)."""
        out = np.broadcast_to(index + self.deltas[np.searchsorted(self.ends, index, side="right")], (3, len(index)))
        out = out.copy()
        k = np.searchsorted(self.offsets, index, side="right") - 1
        image = (k >= 0) & (index < self.ends[np.maximum(k, 0)])
        if image.any():
            k, local = k[image], index[image] - self.offsets[k[image]]
            area = self.grids[k, 1] * self.grids[k, 2]
            within = local % area
            out[:, image] = self.starts[k] + np.stack([local // area, within // self.grids[k, 2],
                                                       within % self.grids[k, 2]])
        return out, image


class MRopePositions:
    """The held requests' image layouts; a step's RoPE positions from them."""

    def __init__(self, model, max_step_tokens: int):
        self.model = model
        model.reserve_rope_rows(max_step_tokens)  # at start, before anything keeps the tables' address
        self.merge = model.spatial_merge_size
        self.layouts: dict[str, ImageLayout] = {}

    def add(self, req_id: str, images: list[ImageInput]) -> None:
        self.layouts.pop(req_id, None)
        if images:
            self.layouts[req_id] = ImageLayout.of(images, self.merge)

    def drop(self, req_id: str) -> None:
        self.layouts.pop(req_id, None)

    def step_positions(self, req_ids: list[str], starts: np.ndarray, counts: np.ndarray,
                       device: torch.device) -> torch.Tensor | None:
        """The RoPE positions of a step in which request ``req_ids[i]`` computes indices
        ``[starts[i], starts[i] + counts[i])``, its tokens after those before it; None when no
        scheduled request has an image (every position is then its index)."""
        if self.layouts.keys().isdisjoint(req_ids):
            return None
        text, image_rows, image_positions = [], [], []
        first = 0
        for req_id, start, count in zip(req_ids, starts.tolist(), counts.tolist()):
            index = np.arange(start, start + count, dtype=np.int64)
            layout = self.layouts.get(req_id)
            if layout is None:
                text.append(index)
            else:
                three, image = layout.positions(index)
                text.append(three[0])
                image_rows.append(first + np.flatnonzero(image))
                image_positions.append(three[:, image].T)
            first += count
        positions = torch.from_numpy(np.concatenate(text)).to(device)
        rows = np.concatenate(image_rows) if image_rows else np.zeros(0, dtype=np.int64)
        if len(rows):
            table_rows = self.model.mrope_rows(torch.from_numpy(np.concatenate(image_positions)))
            positions[torch.from_numpy(rows).to(device)] = table_rows.to(device)
        return positions

"""Calibrating an FP8 KV pool at start: per layer, the K and V scales (and K's shift) of one
forward pass over a calibration text (``kernels/kv_quant.py`` holds the format, the rotation and
the scale rule).

The runner calls ``calibrate_kv_scales`` when ``--kv-cache-dtype fp8``; ``scripts/eval_quant.py``
calls it on its own model.
"""

from __future__ import annotations

import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.kernels.kv_quant import CALIBRATION_TEXT, KVScales, kv_scales_from, rotation, set_kv_scales
from folio.core.tokenizer.text import TextTokenizer


def calibration_ids(model_path: str | None, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT in the model's tokens; without a tokenizer, 256 ids spread over the vocabulary."""
    if model_path is not None:
        try:
            ids = TextTokenizer(model_path).hf.encode(CALIBRATION_TEXT)
            if ids and max(ids) < vocab_size:
                return list(ids)
        except Exception:  # noqa: BLE001 (a test model without a tokenizer: the fallback below)
            pass
    return [(i * 7919 + 13) % vocab_size for i in range(256)]


@torch.inference_mode()
def calibrate_kv_scales(model, backend, device: torch.device, block_size: int,
                        token_ids: list[int]) -> list[KVScales]:
    """Sets the rotation on the model's attention layers, then per layer the ``KVScales`` of the
    rotated K and V from one forward pass over ``token_ids`` (a single sequence) into a scratch pool
    of the model's dtype (``kv_quant.kv_scales_from``: K's per-channel mean as its shift, none on a
    soft-capped layer); sets those too and returns them."""
    n = len(token_ids)
    num_blocks = (n + block_size - 1) // block_size
    attn = model.layers[0].self_attn
    dtype = model.rope_cos.dtype if model.rope_cos is not None else torch.float32
    r = rotation(attn.head_dim, dtype, device)
    for layer in model.layers:
        layer.self_attn.kv_rotation = r
    dims = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
    scratch = [(torch.zeros(dims, dtype=dtype, device=device), torch.zeros(dims, dtype=dtype, device=device))
               for _ in model.layers]
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], None, block_size, device)
    model(torch.tensor(token_ids, dtype=torch.long, device=device), meta.positions, scratch, meta, backend)
    scales = [kv_scales_from(k.flatten(0, 1)[:n], v.flatten(0, 1)[:n], shift=not layer.self_attn.softcap)
              for (k, v), layer in zip(scratch, model.layers)]
    set_kv_scales(model, scales)
    return scales

"""Sliding windows and the KV pool: which window lets the allocator give blocks back, and what an
interleaved local/global model holds against an ideal hybrid layout. Torch-free, from a
checkpoint's ``config.json`` or a model's per-layer windows.

The pool has one block table per sequence for every layer. When every layer attends to at most
its last W positions (Mistral with ``sliding_window``, Phi-3, Qwen2 with ``use_sliding_window``
on every layer) the blocks behind the window go back as the sequence grows
(``BlockAllocator(sliding_window=W)``). When only some layers are windowed (Gemma 2: every other
layer; Gemma 3: five local layers to one global) the global layers need every position, so the
one table keeps every block: ``hybrid_kv_bytes`` says how much more that holds than a layout in
which the local layers keep only their window (vLLM's hybrid allocator: a second block-table
group for the local layers).
"""

from __future__ import annotations

from typing import NamedTuple

from folio.core.kv.allocator import cdiv

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_windows_from_config(config: dict) -> tuple[int, ...]:
    """Each layer's window (0: global) from a ``config.json``, as transformers applies it:
    ``layer_types`` where the config has them (transformers 5 writes them for Qwen2/3 and Gemma),
    else older configs' keys: Qwen2/3's ``use_sliding_window`` from layer ``max_window_layers`` on,
    Gemma 2's every other layer, Gemma 3's ``sliding_window_pattern``; other families put
    ``sliding_window`` (None or 0: none) on every layer. A multimodal config's ``text_config`` is
    the decoder's."""
    config = config.get("text_config") or config
    num_layers = int(config["num_hidden_layers"])
    window = int(config.get("sliding_window") or 0)
    types = config.get("layer_types")
    if not types:
        model_type = config.get("model_type", "")
        if "use_sliding_window" in config:
            first = int(config.get("max_window_layers", num_layers)) if config["use_sliding_window"] else num_layers
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif model_type == "gemma2":
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        elif model_type.startswith("gemma3"):
            pattern = int(config.get("sliding_window_pattern", 6))
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        else:
            types = [SLIDING] * num_layers
    return tuple(window if t == SLIDING else 0 for t in types)


def all_layers_window(layer_windows) -> int:
    """The window the allocator may free behind: every layer's, when every layer has one (the
    widest, when they differ), else 0 (some layer reads every position: no block is ever free)."""
    layer_windows = tuple(layer_windows)
    if not layer_windows or min(layer_windows) <= 0:
        return 0
    return max(layer_windows)


def window_blocks(num_tokens: int, window: int, block_size: int) -> int:
    """Blocks a table needs for a sequence of ``num_tokens`` whose next query sits at position
    ``num_tokens``: those from the block of position ``num_tokens - window + 1`` on (all of them
    when ``window`` is 0)."""
    num_blocks = cdiv(num_tokens, block_size)
    if not window:
        return num_blocks
    return num_blocks - max(0, (num_tokens - window + 1) // block_size)


class HybridBytes(NamedTuple):
    held: int  # bytes one table for all layers holds (every block, for every layer)
    ideal: int  # bytes with the local layers holding only their window's blocks


def hybrid_kv_bytes(layer_windows, num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype_bytes: int = 2) -> HybridBytes:
    """One sequence's KV bytes under one table for every layer (what folio's pool does for an
    interleaved model: nothing is freed) against an ideal hybrid layout (each local layer keeps
    only the blocks its window still reads, a global layer keeps them all)."""
    layer_windows = tuple(layer_windows)
    block_bytes = 2 * block_size * num_kv_heads * head_dim * dtype_bytes  # K and V of one layer
    shared = window_blocks(num_tokens, all_layers_window(layer_windows), block_size)
    held = shared * block_bytes * len(layer_windows)
    ideal = sum(window_blocks(num_tokens, w, block_size) for w in layer_windows) * block_bytes
    return HybridBytes(held, ideal)

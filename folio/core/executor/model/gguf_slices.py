"""One rank's slices of a GGUF checkpoint, read from the memory-mapped file (``sharded_load.py`` uses it).

``gguf.GGUFReader`` maps the file; each quantized tensor is a ``[rows, row bytes]`` array of
blocks that run along the contiguous input dimension (32 values per block for Q4_0/Q4_1/Q8_0,
256 for the K-quants). A slice of output rows is a slice of whole rows; a slice of input columns
is a slice of whole blocks, so it must start and end on a block boundary (refused otherwise).
Only the slice's bytes are touched and dequantized, so no rank holds the whole dense model.

The tensors come out exactly as ``transformers``' GGUF conversion gives them (``folio/core/models.py``
``load_gguf_state``, the unsharded path): HF names, fp32, and the llama q/k rows un-permuted
(llama.cpp interleaves each head's rotary halves; the permutation stays within a head, so a
slice of whole heads is un-permuted on its own).
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import torch

from folio.core.executor.quant.formats import GGUF_LINEARS

_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> the Hugging Face one (None for tensors we do not load)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    kind = GGUF_LINEARS.get(parts[2]) or _NORMS.get(parts[2])
    return f"model.layers.{parts[1]}.{kind}.{parts[3]}" if kind else None


class GGUFSlices:
    """Reads slices of HF-named tensors from a GGUF file, dequantizing only what is asked for."""

    def __init__(self, path: Path, config):
        import gguf

        self.config = config
        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self.tensors[name] = t
        # the metadata (the tokenizer's ~100k strings as small arrays) is ~150 MB of Python objects
        # for SmolLM2; the config was read already, so let it go before the weights arrive
        self.reader.fields.clear()
        gc.collect()

    def read(self, name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
        import gguf

        if name not in self.tensors:
            raise KeyError(f"checkpoint lacks {name}")
        t = self.tensors[name]
        data = t.data  # numpy view of the mapped file: rows x row bytes (quantized) or rows x values
        qtype = t.tensor_type
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if dim == 0:
            data = data[start:end]
        elif dim == 1:
            if start % block or end % block:
                raise ValueError(f"{name}: columns {start}:{end} do not fall on its {qtype.name} blocks of "
                                 f"{block} values; choose a tensor-parallel size that splits whole blocks")
            data = data[:, start // block * type_size: end // block * type_size]
        values = gguf.dequantize(np.ascontiguousarray(data), qtype)
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
        order = self._row_order(name, tensor.shape[0]) if dim != 1 else None
        return tensor if order is None else tensor[order]

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """transformers' ``reverse_permute_weights`` for llama q/k, per head of the rows read."""
        if getattr(self.config, "model_type", "llama") not in ("llama", "mistral"):
            return None
        if not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        head_dim = getattr(self.config, "head_dim", None) or head_dim
        heads = rows // head_dim
        return torch.arange(rows).reshape(heads, head_dim // 2, 2).transpose(1, 2).reshape(rows)

"""Quantized weight formats: what a checkpoint holds, and the two forms the runtime serves.

``Int4Weight`` (asymmetric, one scale and zero per group of ``group_size`` input channels,
``w = (q - 8) * scale + zero`` with ``q`` in 0..15, the form torch's packed CPU op takes) and
``Int8Weight`` (symmetric, one scale per output channel, ``w = q * scale``). Every source is turned
into one of them here:

- GGUF Q4_1 blocks (``d * q + m`` over 32 weights) are an int4 group of 32 with
  ``scale = d`` and ``zero = m + 8 * d``: a lossless repack;
- AutoAWQ "GEMM" tensors (``qweight [in, out/8]``, ``qzeros [in/g, out/8]``, ``scales [in/g, out]``,
  nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7) are ``(q - z) * s``: ``zero = (8 - z) * s``;
- dense weights are rounded to nearest (``quantize_int4`` / ``quantize_int8``).

``loader.py`` asks ``read_checkpoint_quant`` which linear weights a checkpoint holds quantized;
``linear.py`` packs them for the CPU; ``folio/cli/awq.py`` writes AutoAWQ folders with ``pack_awq``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds column AWQ_ORDER[i] of its 8
QUANT_METHODS = ("auto", "none", "int8", "int4", "awq", "fp8")
FOLIO_INT8 = "folio-int8"  # quant_method of folio's own int8 folders (int8 weight + fp32 weight_scale)
# GGUF tensor names -> Hugging Face linear names (per layer)
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


@dataclass
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / group_size] fp32
    zero: torch.Tensor  # [N, K / group_size] fp32; w = (q - 8) * scale + zero
    group_size: int

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32
        g = self.group_size
        q = self.q.float().view(self.q.shape[0], -1, g) - 8.0
        return (q * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(self.q.shape)


@dataclass
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] fp32; w = q * scale

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.unsqueeze(-1)


def concat_rows(parts: list):
    """Fuse projections along the output dimension (q/k/v, gate/up), whatever their form."""
    if all(isinstance(p, Int4Weight) for p in parts):
        sizes = {p.group_size for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"fused projections quantized with different group sizes {sorted(sizes)}")
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].group_size)
    if all(isinstance(p, Int8Weight) for p in parts):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    raise ValueError("fused projections must share one quantized form")


def check_group_size(shape: tuple[int, int], group_size: int, name: str = "weight") -> None:
    if group_size <= 0 or shape[1] % group_size:
        fits = [g for g in (32, 64, 128) if shape[1] % g == 0]
        raise ValueError(f"{name} has {shape[1]} input channels, not a multiple of group size {group_size}"
                         + (f"; use {' or '.join(map(str, fits))}" if fits else ""))


# ---------------------------------------------------------------------------- round to nearest
def quantize_int4(w: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> Int4Weight:
    """Asymmetric round-to-nearest with integer zero points (AutoAWQ's grid), per group.

    ``clip`` ([N, K/g], optional) caps each group's range at ``max|w|`` times it, as AWQ's
    clipping search does."""
    check_group_size(tuple(w.shape), group_size)
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    hi, lo = wg.amax(-1), wg.amin(-1)
    if clip is not None:
        bound = wg.abs().amax(-1) * clip
        hi, lo = torch.minimum(hi, bound), torch.maximum(lo, -bound)
    s = ((hi - lo).clamp(min=1e-5) / 15.0)
    z = (-lo / s).round().clamp(0, 15)
    q = (wg / s.unsqueeze(-1)).round().add(z.unsqueeze(-1)).clamp(0, 15)
    return Int4Weight(q.reshape(n, k).to(torch.uint8), s, (8.0 - z) * s, group_size)


def int4_zero_points(w: Int4Weight) -> torch.Tensor:
    """Integer zero points z with ``(q - z) * s == (q - 8) * s + zero``; exact for weights from
    ``quantize_int4`` or AWQ, raises for others (a Q4_1 minimum is not on the grid)."""
    z = 8.0 - w.zero / w.scale
    if not on_awq_grid(w):
        raise ValueError("these int4 weights have zero points off the integer grid (not AWQ-expressible)")
    return z.round().clamp(0, 15).to(torch.int32)


def on_awq_grid(w: Int4Weight) -> bool:
    """Whether ``int4_zero_points`` can express ``w`` (AWQ's and ``quantize_int4``'s can, Q4_1's not)."""
    z = 8.0 - w.zero / w.scale
    return bool(torch.allclose(z, z.round(), atol=1e-3))


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel round-to-nearest."""
    s = w.float().abs().amax(-1).clamp(min=1e-8) / 127.0
    q = (w.float() / s.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, s)


# ---------------------------------------------------------------------------- GGUF
def _q4_1_rows(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows ``[N, K/32 * 20]`` bytes -> (q [N, K] uint8, d [N, K/32], m [N, K/32])."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # byte j: element j in its low nibble, element j + 16 in its high one
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    return torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(m)


def _gguf_row_order(name: str, n: int, config) -> torch.Tensor | None:
    """llama.cpp permutes q/k rows for its RoPE layout; transformers undoes it (the same rows)."""
    if getattr(config, "model_type", "llama") not in ("llama", "mistral") or name not in ("attn_q", "attn_k"):
        return None
    heads = config.num_attention_heads if name == "attn_q" else config.num_key_value_heads
    dim = n // heads // 2
    return torch.arange(n).reshape(heads, dim, 2).transpose(1, 2).reshape(n)


def read_gguf_quant(path: Path, config) -> tuple[str, dict[str, Int4Weight]]:
    """The linear weights a GGUF holds as Q4_1, repacked losslessly into ``Int4Weight``s (HF names).

    Returns the checkpoint's own method: ``int4`` when its projections are Q4_1, ``int8`` when
    they are Q8_0 (served by per-channel requantization), else ``none``."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, Int4Weight] = {}
    kinds = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LINEARS:
            continue
        kinds.add(t.tensor_type.name)
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        q, d, m = _q4_1_rows(np.asarray(t.data))
        order = _gguf_row_order(parts[2], q.shape[0], config)
        if order is not None:
            q, d, m = q[order], d[order], m[order]
        out[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}.weight"] = Int4Weight(q, d, m + 8.0 * d, 32)
    if kinds == {"Q4_1"}:
        return "int4", out
    if kinds == {"Q8_0"}:
        return "int8", {}
    return "none", {}


# ---------------------------------------------------------------------------- AutoAWQ GEMM layout
def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` ints in 0..15 -> ``[rows, cols/8]`` int32 in AutoAWQ's nibble order."""
    v = values.to(torch.int32).reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    word = (v.to(torch.int64) << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)  # 0 .. 2**32 - 1
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)  # the same bits, signed


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[rows, cols/8]`` int32 -> ``[rows, cols]`` uint8, undoing ``pack_awq``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # nib[..., i] is column AWQ_ORDER[i]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]
    return nib[..., inverse].reshape(packed.shape[0], -1).to(torch.uint8)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    """AutoAWQ GEMM tensors of one linear -> ``Int4Weight`` ([out, in] orientation)."""
    q = unpack_awq(qweight).t().contiguous()  # [out, in]
    z = unpack_awq(qzeros).t().float()  # [out, in/g]
    s = scales.t().float()
    return Int4Weight(q, s.contiguous(), ((8.0 - z) * s).contiguous(), group_size)


def int4_to_awq(w: Int4Weight) -> dict[str, torch.Tensor]:
    """``Int4Weight`` -> AutoAWQ GEMM tensors (``qweight``, ``qzeros``, ``scales`` fp16)."""
    z = int4_zero_points(w)
    return {"qweight": pack_awq(w.q.t().contiguous()), "qzeros": pack_awq(z.t().contiguous()),
            "scales": w.scale.t().contiguous().half()}


def read_awq_state(state: dict[str, torch.Tensor], group_size: int) -> dict[str, Int4Weight]:
    """Every ``*.qweight`` of an AWQ checkpoint as ``Int4Weight`` under its ``*.weight`` name."""
    out = {}
    for name in [n for n in state if n.endswith(".qweight")]:
        base = name[: -len(".qweight")]
        out[base + ".weight"] = awq_to_int4(state[name], state[base + ".qzeros"], state[base + ".scales"],
                                            group_size)
    return out


def read_int8_state(state: dict[str, torch.Tensor]) -> dict[str, Int8Weight]:
    """folio's own int8 folders: ``*.weight`` int8 with ``*.weight_scale`` fp32 per channel."""
    return {n: Int8Weight(t, state[n + "_scale"].float()) for n, t in state.items()
            if t.dtype == torch.int8 and n + "_scale" in state}


def folder_quant_config(folder: Path) -> dict | None:
    config = folder / "config.json"
    if not config.exists():
        return None
    return json.loads(config.read_text()).get("quantization_config")

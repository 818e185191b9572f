"""Quantized linear layers for the CPU, and swapping them into a loaded model.

Decode rows go through torch's packed kernels (``_weight_int4pack_mm_for_cpu`` for int4 groups,
``_weight_int8pack_mm`` for per-channel int8). Those kernels are fast only with bf16 activations
(fp32 ones are 10-30x slower), so a quantized layer casts its input to bf16 and its output back:
the rest of the model (residual stream, norms, attention, the KV pool) stays in the model's dtype
(fp32 on the CPU by default). The packed kernels lose to a dense bf16 GEMM once a call has more
than ``PACKED_MAX_ROWS`` rows (prefill chunks, big batches), so layers also keep their weight
dequantized to bf16 for those calls (2 bytes per weight on top of the packed 0.5 or 1: memory is
not what this CPU path saves; decode bandwidth is).

``loader.py`` calls ``quantize_model``; ``runner.py`` leaves these layers out of oneDNN packing.
"""

from __future__ import annotations

import torch
from torch import nn

from services.executor.quant_formats import Int4Weight, Int8Weight

# Rows above which the dense bf16 GEMM beats the packed kernels on this CPU (2 cores, AVX-512 bf16;
# scripts/bench_quant_linear.py measures it: SmolLM2's shapes cross over between 8 and 16 rows).
PACKED_MAX_ROWS = 8
ACT_DTYPE = torch.bfloat16


def int4_pack_for_cpu(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scale-and-zero ``[K/g, N, 2]`` bf16) for ``_weight_int4pack_mm_for_cpu``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32).contiguous(), 2)
    scale_zero = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(ACT_DTYPE).contiguous()
    return packed, scale_zero


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W held int4 (grouped) or int8 (per channel)."""

    max_packed_rows = PACKED_MAX_ROWS  # scripts/eval_quant.py raises it to score the packed path alone

    def __init__(self, weight: Int4Weight | Int8Weight, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.bits = 4 if isinstance(weight, Int4Weight) else 8
        if self.bits == 4:
            self.group_size = weight.group_size
            self.packed, self.scale_zero = int4_pack_for_cpu(weight)
        else:
            self.packed = weight.q.contiguous()
            self.scale = weight.scale.to(ACT_DTYPE)
        # rows past PACKED_MAX_ROWS go through a dense bf16 copy (the dequantized weight)
        self.dense = (weight.dequantize() if dense is None else dense).to(ACT_DTYPE)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in_features]
        xa = x.to(ACT_DTYPE)
        if x.shape[0] > self.max_packed_rows:
            y = torch.nn.functional.linear(xa, self.dense)
        elif self.bits == 4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.packed, self.group_size, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int8pack_mm(xa, self.packed, self.scale)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}"


def quant_layers_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_weight_int8pack_mm")


def quantize_model(model, weights: dict[str, Int4Weight | Int8Weight], head: Int8Weight | None) -> None:
    """Swap each projection named in ``weights`` (our fused names, e.g. ``layers.0.mlp.gate_up_proj``)
    for a ``QuantLinear``, and give the model a quantized LM head when ``head`` is set."""
    if not quant_layers_available():
        raise ValueError("this torch build lacks the packed int4/int8 CPU kernels")
    for name, w in weights.items():
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, attr)
        setattr(parent, attr, QuantLinear(w, layer.bias, layer.weight))
    if head is not None:
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.packed_lm_head = QuantLinear(head, None, weight)
        model.lm_head = None

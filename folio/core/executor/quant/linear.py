"""Quantized linear layers and LM head for the CPU, and swapping them into a loaded model.

``QuantLinear`` multiplies with a weight in a GGUF type's tiles (``cpu_gemm.PackedWeight``: GGUF
files are served in their own types; folio's int4/int8 weights as Q4_1/Q8_0 tiles) through folio's
kernels, activations quantized to int8 inside each call; with ``--cpu-quant-activations bf16``,
int4 and int8 weights go through torch's packed kernels instead. ``QuantEmbedding`` keeps a GGUF
embedding table in its type; ``QuantLMHead`` is the head (docs/quantization.md: how a dense head is
approximated and refined). Every row of a call is computed on its own, in one order: a row's result
does not depend on the batch. ``loader.py`` calls ``quantize_model``.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.core.executor.quant import cpu_gemm
from folio.core.executor.quant.cpu_gemm import BLOCK, TILE
from folio.core.executor.quant.formats import Int4Weight, Int8Weight

ACT_DTYPE = torch.bfloat16
INVARIANT_ROWS = 16  # rows per oneDNN call of a batch-invariant head (its rows agree in calls of 2..17)
REFINE_TOP = 64  # logits per row the LM head recomputes exactly (see QuantLMHead)
Q8_BLOCK_BYTES = 544  # cpu_gemm's int8 block: 512 values and 16 fp16 scales


def int4_pack_for_cpu(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scale-and-zero ``[K/g, N, 2]`` bf16) for ``_weight_int4pack_mm_for_cpu``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32).contiguous(), 2)
    scale_zero = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(ACT_DTYPE).contiguous()
    return packed, scale_zero


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 64-byte aligned address: torch's packed CPU kernels load their operands
    with aligned vector loads and crash on others (``_weight_int8pack_mm`` did on an int8 weight
    read from a safetensors file, whose tensors sit at 8-byte offsets)."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> Int4Weight:
    """The ``Int4Weight`` (groups of 32) of Q4_1 tiles (fp16 scales, as stored)."""
    tiles, blocks = (n + TILE - 1) // TILE, k // BLOCK
    raw = packed.view(tiles, blocks, 320)
    nibbles = raw[..., :256].reshape(tiles, blocks, 4, TILE, 4)  # [t, b, chunk, r, j]
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=3)  # [t, b, chunk, half, r, j]
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, k)[:n]
    halves = raw[..., 256:].contiguous().view(torch.float16).float()  # [t, b, 32]: d then m per row
    d = halves[..., :TILE].permute(0, 2, 1).reshape(tiles * TILE, blocks)[:n]
    m = halves[..., TILE:].permute(0, 2, 1).reshape(tiles * TILE, blocks)[:n]
    return Int4Weight(q.contiguous(), d.contiguous(), (m + 8.0 * d).contiguous(), BLOCK)


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> Int8Weight:
    """The per-channel ``Int8Weight`` of Q8_0 tiles whose blocks share their row's scale."""
    values = packed.view(-1, k // BLOCK, Q8_BLOCK_BYTES)[..., :512]
    q = values.reshape(-1, k // BLOCK, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(-1, k)[:n].view(torch.int8)
    d = packed.view(-1, k // BLOCK, Q8_BLOCK_BYTES)[:, 0, 512:].contiguous().view(torch.float16)
    return Int8Weight(q.contiguous(), d.float().reshape(-1)[:n].contiguous())


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W quantized: a GGUF type's tiles (``cpu_gemm.PackedWeight``), or
    folio's int4 groups / per-channel int8 (packed as Q4_1 / Q8_0 tiles).

    With folio's kernels (``int8_activations``, the default) each call quantizes its rows to int8
    per block of 32 in ``passes`` passes and multiplies in integers, reading W once for every row
    of the call; otherwise torch's packed kernels take bf16 rows (``--cpu-quant-activations bf16``,
    int4 and int8 weights only), in a form made from the tiles when the setting asks for it."""

    int8_activations = True  # the runner sets it from --cpu-quant-activations
    passes = 2  # int8 passes per activation block

    def __init__(self, weight: Int4Weight | Int8Weight | cpu_gemm.PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = (weight.n, weight.k) if isinstance(weight, cpu_gemm.PackedWeight) \
            else weight.q.shape
        self.packed = self.scale_zero = self.scale = self.weight_packed = None
        self.group_size = 0
        self._qgemm = None
        if isinstance(weight, cpu_gemm.PackedWeight):
            self.weight_packed = weight
        elif cpu_gemm.available() and self.in_features % BLOCK == 0 and getattr(weight, "group_size", BLOCK) % BLOCK == 0:
            if isinstance(weight, Int4Weight):
                self.weight_packed = cpu_gemm.PackedWeight.from_int4(weight)
            else:  # a per-channel scale is every block's
                blocks = weight.scale.float()[:, None].expand(-1, self.in_features // BLOCK)
                self.weight_packed = cpu_gemm.PackedWeight.from_int8(weight.q, blocks.half().float())
        else:
            self._torch_form(weight)
        self.bias = bias

    def _torch_form(self, weight: Int4Weight | Int8Weight) -> None:
        if isinstance(weight, Int4Weight):
            self.group_size = weight.group_size
            self.packed, self.scale_zero = int4_pack_for_cpu(weight)
        else:
            self.packed = aligned(weight.q)
            self.scale = aligned(weight.scale.to(ACT_DTYPE))

    def _weight_from_tiles(self) -> Int4Weight | Int8Weight:
        w = self.weight_packed
        kinds = w.types
        if kinds == ["Q4_1"]:
            return unpack_int4(w.parts[0].tiles, self.out_features, self.in_features)
        if kinds == ["Q8_0"]:
            return unpack_int8(w.parts[0].tiles, self.out_features, self.in_features)
        raise ValueError(f"--cpu-quant-activations bf16 takes int4 (Q4_1) and int8 (Q8_0) weights, not {kinds}; "
                         "serve this model with int8 activations")

    def set_int8_activations(self, on: bool) -> None:
        """folio's kernels (on) or torch's: folio's tiles are the source, torch's form is made from
        them when asked for and dropped when not used."""
        self.int8_activations = on
        if self.weight_packed is None:
            return  # no compiler here: torch's form is the only one
        if on:
            self.packed = self.scale_zero = self.scale = None
        elif self.packed is None:
            self._torch_form(self._weight_from_tiles())

    @property
    def bits(self) -> int:
        if self.weight_packed is not None:
            return 8 if self.weight_packed.types == ["Q8_0"] else 4
        return 8 if self.scale is not None else 4

    def __getstate__(self) -> dict:
        state = super().__getstate__().copy()
        state["_qgemm"] = None  # ctypes functions: bound again after loading
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in_features]
        if self.weight_packed is not None and self.int8_activations:
            if self._qgemm is None or self._qgemm.passes != self.passes:
                self._qgemm = cpu_gemm.QGemm(self.weight_packed, self.passes)
            y = self._qgemm(x)
            return y if self.bias is None else y + self.bias
        xa = aligned(x if x.dtype == ACT_DTYPE else x.to(ACT_DTYPE))  # bf16 already from the CPU kernels
        if self.scale_zero is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.packed, self.group_size, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int8pack_mm(xa, self.packed, self.scale)
        if x.dtype != ACT_DTYPE:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kinds = "+".join(self.weight_packed.types) if self.weight_packed is not None else f"torch int{self.bits}"
        return f"in={self.in_features}, out={self.out_features}, {kinds}"


class QuantEmbedding(nn.Module):
    """The embedding table kept in its GGUF type: a lookup dequantizes the rows it reads (the values
    GGUF's dequantization gives). ``weight`` (the whole table in fp32) is made only when something
    asks for it (an eagle3 head's fingerprint and draft vocabulary)."""

    def __init__(self, weight: cpu_gemm.PackedWeight):
        super().__init__()
        self.table = weight
        self._dense: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden] fp32, as nn.Embedding
        return self.table.rows(input_ids).view(*input_ids.shape, self.table.k)

    @property
    def weight(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.table.dequantize()
        return self._dense

    def __getstate__(self) -> dict:
        state = super().__getstate__().copy()
        state["_dense"] = None
        return state


SMALL_ROWS = 4  # calls of up to this many rows take the LM head's int4 pair (measured faster up to 4 here)
HEAD_GROUP = 32


def int8_as_int4_pair(weight: torch.Tensor, group: int = HEAD_GROUP) -> tuple[Int4Weight, Int4Weight]:
    """Symmetric int8 groups of ``weight`` (``d = max|w| / 127``, the layout of GGUF's Q8_0, which
    this recovers exactly from its dequantized values) written as two int4 weights whose sum is
    the int8 one: with ``u = q + 128 = 16 hi + lo``, ``w = d q = 16 d hi + d (lo - 8) + 8 d``, so
    the high nibbles take scale 16 d and zero 0, the low ones scale d and zero 8 d."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group, group)
    d = groups.abs().amax(-1) / 127.0  # [n, k / group]
    q = torch.where(d[..., None] > 0, torch.round(groups / d.clamp(min=1e-30)[..., None]), 0).clamp(-127, 127)
    u = (q + 128).to(torch.int32).view(n, k)
    hi, lo = (u >> 4).to(torch.uint8), (u & 15).to(torch.uint8)
    return (Int4Weight(hi, 16 * d, torch.zeros_like(d), group), Int4Weight(lo, d, 8 * d, group))


class QuantLMHead(nn.Module):
    """The LM head of a quantized model: approximate logits for every token, then the
    ``REFINE_TOP`` largest of each row recomputed from the exact weights (in the model's dtype).

    The approximate pass reads a bf16 copy of the weights, or for calls of up to ``SMALL_ROWS``
    rows (decode at small batches, where this one GEMM was a quarter of SmolLM2's step) the
    weights' int8 groups as a pair of int4 weights through the packed int4 kernel, which reads a
    quarter of the bf16 bytes (bf16 group scales: about the precision of the bf16 copy).
    The head decides the ranking of close candidates: on SmolLM2 a bf16 head alone cost 3.6e-4
    of mean KLD and 1 point of top-1 agreement against the fp32 reference, a per-channel int8
    head 1.6e-3 (scripts/eval_quant.py), more than all the int4 layers. The probability mass sits
    in the top few logits, so refining those restores nearly all of it for a few rows' work. A
    row's refined logits are exact whichever pass found them; only the tail beyond them depends
    on the call's size, unless ``batch_invariant``: then every call takes a oneDNN-packed copy (bf16,
    or fp32 where oneDNN has no bf16 path) in calls of 2 to ``INVARIANT_ROWS`` rows, a lone row
    padded to two, where oneDNN's rows agree bit for bit whatever else is in the call (tested), so
    a token's whole distribution, logprobs included, is the same in any batch. (The int4 pair is
    row-invariant too, but 14x slower than the packed copy at 64 rows.)"""

    batch_invariant = False  # the runner sets it from --batch-invariant
    int8_activations = True  # the runner sets it from --cpu-quant-activations

    def __init__(self, weight: torch.Tensor | cpu_gemm.PackedWeight):
        super().__init__()
        # a GGUF head in its own type: its tiles are the exact weights (nothing to refine from) and
        # are read with two int8 passes; a dense head: the copies below, refined from ``weight``
        self.tiles = weight if isinstance(weight, cpu_gemm.PackedWeight) else None
        self.weight = None if self.tiles is not None else weight  # [vocab, hidden], shared with the embedding when tied
        # the copies the approximate pass reads: folio's int8 blocks (with --cpu-quant-activations
        # int8), else the bf16 copy and the int4 pair, or only the oneDNN-packed copy of a
        # batch-invariant head (the others are dropped when it is made)
        self.weight_bf16 = self.pair = self.packed = self.qhead = None
        self._qgemm = None
        if self.tiles is None:
            self._copies_for_any_batch()

    def _int8_blocks_usable(self) -> bool:
        return self.int8_activations and cpu_gemm.available() and self.weight.shape[1] % BLOCK == 0

    def set_int8_activations(self, on: bool) -> None:
        self.int8_activations = on
        if self.tiles is not None and not on:  # torch's kernels read a dense copy: the user asked for it
            self.weight, self.tiles, self._qgemm = self.tiles.dequantize(), None, None
        if self.tiles is not None:
            return
        if (self.qhead is not None) != self._int8_blocks_usable():
            self.weight_bf16 = self.pair = self.packed = self.qhead = self._qgemm = None
            self._copies_for_any_batch()

    def __getstate__(self) -> dict:
        state = super().__getstate__().copy()
        state["_qgemm"] = None  # ctypes functions: bound again after loading
        return state

    def _copies_for_any_batch(self) -> None:
        weight = self.weight
        if self._int8_blocks_usable():  # one pass of integer dots; its rows are batch-invariant
            self.qhead = cpu_gemm.PackedWeight.from_int8(*cpu_gemm.int8_blocks(weight))
            return
        self.weight_bf16 = weight.to(ACT_DTYPE)
        if weight.shape[1] % HEAD_GROUP == 0 and weight.shape[0] % 16 == 0:  # what the packed kernel takes
            self.pair = [int4_pack_for_cpu(w) for w in int8_as_int4_pair(weight)]

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        if self.packed is None:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(ACT_DTYPE), None)
            except RuntimeError:  # no bf16 path in oneDNN on this CPU (AVX2 only)
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.float(), None)
            self.weight_bf16 = self.pair = None
        xa = x.to(self.packed.dtype)
        parts = []
        for start in range(0, xa.shape[0], INVARIANT_ROWS):
            rows = xa[start:start + INVARIANT_ROWS]
            lone = rows.shape[0] == 1
            rows = rows.expand(2, -1).contiguous() if lone else rows.contiguous()
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
            parts.append(out[:1] if lone else out)
        return torch.cat(parts).float()

    def approximate(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        if self.tiles is not None:  # the layers' passes (a GGUF head's weights are exact: nothing to refine)
            if self._qgemm is None or self._qgemm.passes != QuantLinear.passes:
                self._qgemm = cpu_gemm.QGemm(self.tiles, passes=QuantLinear.passes)
            return self._qgemm(x, out_dtype=torch.float32)
        if self.qhead is not None:
            if self._qgemm is None:
                self._qgemm = cpu_gemm.QGemm(self.qhead, passes=1)  # refined below
            return self._qgemm(x, out_dtype=torch.float32)
        if self.batch_invariant:
            return self._invariant(x)
        if self.weight_bf16 is None:  # the flag was turned off after the packed copy was made
            self.packed = None
            self._copies_for_any_batch()
        xa = aligned(x.to(ACT_DTYPE))
        if self.pair is not None and x.shape[0] <= SMALL_ROWS:
            (hi, hi_sz), (lo, lo_sz) = self.pair
            mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            return mm(xa, hi, HEAD_GROUP, hi_sz).float() + mm(xa, lo, HEAD_GROUP, lo_sz).float()
        return torch.nn.functional.linear(xa, self.weight_bf16).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, hidden] -> [rows, vocab] fp32
        logits = self.approximate(x)
        if self.tiles is not None:
            return logits
        top = logits.topk(min(REFINE_TOP, logits.shape[-1]), dim=-1).indices  # [rows, REFINE_TOP]
        rows = self.weight.index_select(0, top.reshape(-1)).view(*top.shape, -1)  # (aten::index took 0.36 ms)
        exact = torch.einsum("rh,rkh->rk", x.to(self.weight.dtype), rows).float()
        return logits.scatter_(1, top, exact)


def activation_dtype(model) -> torch.dtype:
    """The dtype between a quantized CPU model's layer operations: fp32 when every quantized linear
    takes folio's kernels (which read fp32 rows as cheaply as bf16 ones; a bf16 rounding between
    the operations was then the larger part of the error left), bf16 for torch's packed kernels."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if linears and all(m.weight_packed is not None and m.int8_activations for m in linears):
        return torch.float32
    return ACT_DTYPE


def quant_layers_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_weight_int8pack_mm")


def quantize_model(model, weights: dict, method: str = "", group_size: int = 32,
                   head: cpu_gemm.PackedWeight | None = None) -> None:
    """Swap each projection named in ``weights`` (our fused names, e.g. ``layers.0.mlp.gate_up_proj``;
    ``Int4Weight``, ``Int8Weight`` or ``PackedWeight``) for a ``QuantLinear``; the LM head becomes a
    ``QuantLMHead`` (of ``head``, a GGUF head's tiles, when given). A mixture of experts' routed
    experts are rounded from the model's own weights (``moe.MoE.quantize_experts``, ``method``
    int8 or int4 at ``group_size``)."""
    if not quant_layers_available():
        raise ValueError("this torch build lacks the packed int4/int8 CPU kernels")
    for name, w in weights.items():
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, QuantLinear(w, getattr(parent, attr).bias))
    for module in model.modules():
        if hasattr(module, "quantize_experts"):
            module.quantize_experts(method, group_size)
    weight = head if head is not None else model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.packed_lm_head = QuantLMHead(weight)
    model.lm_head = None

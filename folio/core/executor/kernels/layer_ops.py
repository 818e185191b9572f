"""The elementwise parts of a decoder layer: residual add + RMSNorm, RoPE + KV write, SiLU x gate
(and GeGLU's tanh-GELU x gate).

``model/layers.py`` calls them through the attention backend's ``layer_ops``: the torch backend's are
``TorchLayerOps``, the reference (plain torch, the very ops the model always ran, so the CPU
output is unchanged); the kernel backend's are ``KernelLayerOps``, which launch the fused kernels
of ``cuda/fused_ops.cu`` through the backend's launcher (CuPy on a GPU, the CPU emulation in the
tests) and fall back to the reference for a shape or layout the kernels do not take (a dtype
other than the activations', rows that are not whole 16-byte vectors, misaligned pointers).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.kv_quant import FP8_DTYPE, DeviceScales


def _ptr(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    # fp32 statistics, then back to the activation dtype, as the transformers reference does
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchLayerOps:
    """The reference implementation (any device)."""

    def rope_inputs(self, model, positions: torch.Tensor):
        """Per-step RoPE inputs, gathered once and shared by every layer."""
        return model.rope_cos[positions].unsqueeze(1), model.rope_sin[positions].unsqueeze(1)

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        return _rms_norm(x, norm)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm)."""
        residual = residual + x
        return residual, _rms_norm(residual, norm)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 d] -> [n, d]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 d] -> [n, d]
        """GeGLU (Gemma): tanh-approximated GELU of the gate times up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_write_kv(self, qkv: torch.Tensor, attn, rope, k_cache, v_cache, meta, backend) -> torch.Tensor:
        """Rotates q and k, writes k and v into their slots; returns q [n, num_heads, head_dim]."""
        n = qkv.shape[0]
        cos, sin = rope
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = apply_rope(q.view(n, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(k.view(n, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = v.view(n, attn.num_kv_heads, attn.head_dim)
        if attn.kv_rotation is not None:  # an fp8 pool: q, k and v in the rotated basis (kv_quant)
            q, k, v = q @ attn.kv_rotation, k @ attn.kv_rotation, v @ attn.kv_rotation
        backend.write_kv(k, v, k_cache, v_cache, meta, attn.kv_scales)
        return q


TORCH_LAYER_OPS = TorchLayerOps()


class KernelRope:
    """RoPE inputs of the fused kernel: the whole tables and the positions (no per-step gather);
    ``gathered`` holds the reference's per-token cos/sin once a fallback has needed them."""

    def __init__(self, model, positions: torch.Tensor):
        self.cos_table, self.sin_table, self.positions = model.rope_cos, model.rope_sin, positions
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gathered is None:
            self.gathered = (self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1))
        return self.gathered


def _fits(*tensors: torch.Tensor, row_elems: int) -> bool:
    """Rows of whole 16-byte vectors on 16-byte aligned addresses, in one dtype."""
    t0 = tensors[0]
    return (row_elems * t0.element_size()) % 16 == 0 and all(
        t.dtype == t0.dtype and t.data_ptr() % 16 == 0 and t.stride(-1) == 1
        and (t.dim() == 1 or (t.stride(0) * t.element_size()) % 16 == 0) for t in tensors)


class KernelLayerOps:
    """The fused kernels of ``cuda/fused_ops.cu``, launched by ``launcher`` (see kernel_backend)."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.num_fallbacks = 0  # calls that took the reference path (tests check the kernels ran)
        self._aligned: dict[int, torch.Tensor] = {}  # misaligned norm weights -> aligned copies
        self._scales = DeviceScales()  # an fp8 pool's scales as the kernel reads them

    def _weight(self, norm) -> torch.Tensor:
        """The norm's weight on a 16-byte boundary (a loader may leave it inside a larger buffer)."""
        weight = norm.weight
        if weight.data_ptr() % 16 == 0 or not weight.is_contiguous():
            return weight
        key = weight.data_ptr()
        if key not in self._aligned:
            self._aligned[key] = weight.detach().clone()
        return self._aligned[key]

    def _launch(self, kernel: str, num_tokens: int, threads: int, args, device) -> None:
        names = ck.fused_names(_DTYPE_NAMES[args[-1]])
        self.launcher.launch(names, kernel, (num_tokens, 1, 1), (threads, 1, 1), args[:-1], device)

    def rope_inputs(self, model, positions: torch.Tensor) -> KernelRope:
        return KernelRope(model, positions)

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        if not self._norm_fits(x, x, norm):
            self.num_fallbacks += 1
            return _rms_norm(x, norm)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(out, out, x, norm, add=False)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual is updated in place (the layer owns it: the embedding output or an earlier sum)."""
        if not (self._norm_fits(x, residual, norm) and residual.is_contiguous()):
            self.num_fallbacks += 1
            return TORCH_LAYER_OPS.add_rms_norm(x, residual, norm)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(out, residual, x, norm, add=True)
        return residual, out

    def _norm_fits(self, x, residual, norm) -> bool:
        return x.dim() == 2 and x.dtype in _DTYPE_NAMES and norm.weight.dtype == x.dtype \
            and _fits(x, residual, self._weight(norm), row_elems=x.shape[-1]) and x.shape[0] > 0

    def _norm(self, out, residual, x, norm, add: bool) -> None:
        args = (_ptr(out), _ptr(residual), _ptr(x), _ptr(self._weight(norm)), np.int32(x.shape[1]), np.int64(x.stride(0)),
                np.float32(norm.eps), np.int32(add), x.dtype)
        self._launch("add_rms_norm", x.shape[0], ck.NORM_THREADS, args, x.device)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gated("silu_and_mul", gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # GeGLU (Gemma)
        return self._gated("gelu_tanh_and_mul", gate_up)

    def _gated(self, kernel: str, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 d] -> [n, d]
        """act(gate) x up by ``kernel``, or the reference's op of the same name for what it does not take."""
        n, d = gate_up.shape[0], gate_up.shape[-1] // 2
        if gate_up.dim() != 2 or gate_up.dtype not in _DTYPE_NAMES or n == 0 or not _fits(gate_up, row_elems=d):
            self.num_fallbacks += 1
            return getattr(TORCH_LAYER_OPS, kernel)(gate_up)
        out = torch.empty((n, d), dtype=gate_up.dtype, device=gate_up.device)
        args = (_ptr(out), _ptr(gate_up), np.int32(d), np.int64(gate_up.stride(0)), gate_up.dtype)
        self._launch(kernel, n, ck.ACT_THREADS, args, gate_up.device)
        return out

    def rope_write_kv(self, qkv: torch.Tensor, attn, rope: KernelRope, k_cache, v_cache, meta, backend) -> torch.Tensor:
        """An fp8 pool (f16/bf16 activations) takes the kernel's fp8 instance: the layer's rotation
        and its scales and K shift (``attn.kv_scales``) applied on the write."""
        n, head_dim = qkv.shape[0], attn.head_dim
        slots = meta.slot_mapping
        fp8 = k_cache.dtype == FP8_DTYPE and qkv.dtype in (torch.float16, torch.bfloat16)
        rotation = attn.kv_rotation
        pools = (k_cache, v_cache) if not fp8 else ()  # an fp8 pool is written element by element
        if not (qkv.dim() == 2 and qkv.dtype in _DTYPE_NAMES and n > 0 and (k_cache.dtype == qkv.dtype or fp8)
                and v_cache.dtype == k_cache.dtype
                and (rotation is None or (rotation.dtype == qkv.dtype and rotation.is_contiguous()
                                          and tuple(rotation.shape) == (head_dim, head_dim)))
                and rope.cos_table.dtype == qkv.dtype and slots.dtype == torch.int64 and slots.is_contiguous()
                and rope.positions.dtype == torch.int64 and rope.positions.is_contiguous()
                and k_cache.is_contiguous() and v_cache.is_contiguous()
                and _fits(qkv, rope.cos_table, rope.sin_table, *pools, row_elems=head_dim // 2)):
            self.num_fallbacks += 1
            return TORCH_LAYER_OPS.rope_write_kv(qkv, attn, rope.reference(), k_cache, v_cache, meta, backend)
        q = torch.empty((n, attn.num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        scales = self._scales.pointers(k_cache, attn.kv_scales, with_shift=True)
        args = (_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(qkv), _ptr(rope.positions), _ptr(rope.cos_table),
                _ptr(rope.sin_table), _ptr(slots), np.int32(attn.num_heads), np.int32(attn.num_kv_heads),
                np.int32(head_dim), np.int64(qkv.stride(0)), np.uint64(0 if rotation is None else rotation.data_ptr()),
                *(np.uint64(p) for p in scales))
        if fp8:
            name = ck.rope_write_kv_fp8_name(_DTYPE_NAMES[qkv.dtype])
            self.launcher.launch(SimpleNamespace(rope_write_kv=name), "rope_write_kv", (n, 1, 1), (ck.ROPE_THREADS, 1, 1),
                                 args, qkv.device)
        else:
            self._launch("rope_write_kv", n, ck.ROPE_THREADS, (*args, qkv.dtype), qkv.device)
        return q


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

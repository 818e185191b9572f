"""The CPU kernel backend: a step's norms, RoPE + KV write, SiLU/GELU x gate and decode attention in C.

On the CPU the small operations of a decoder layer cost more than its arithmetic: at batch 1 the
torch ops of SmolLM2's 30 layers (a residual add and RMSNorm as seven ops, RoPE as a dozen, the
gather of each sequence's blocks and SDPA for attention) take longer than its int4 GEMMs. Here
each is one call into ``csrc/layers.c`` (``cpu_kernels.py`` builds it) for the whole step; prefill
chunks longer than ``attention.SHORT_CHUNK_ROWS`` still attend through the torch reference's code
(SDPA: a matrix's work, several threads). A layer's sliding window and logit soft-cap are
parameters of both paths: the C decode loop starts at the window's first key (blocks wholly before
it are not read) and caps each score as the reference does. The backend is made only for an fp32
model over an fp32 pool; a layer operation given a tensor its kernel does not take falls back to
the torch reference, ``TorchLayerOps``, which the tests compare these with (as
``TorchAttentionBackend``).

Activations between the layer's operations are ``act_dtype``: bf16 for a model with quantized
linears (what the packed int4/int8 kernels read and write, so no cast is left around them), else
the model's dtype; the residual stream, the KV pool and the final norm's output stay in the
model's dtype. Every token is computed on its own: its result does not depend on the batch.

``runner.make_backend`` picks it for ``--attention-backend auto`` on the CPU when the model's
linears are quantized (the fp32 ``--quantization none`` path stays the torch reference that the
greedy oracle compares with transformers), or always for ``--attention-backend cpu``.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.kernels.attention import (SHORT_CHUNK_ROWS, TorchAttentionBackend, _TorchPlan, _write_idx,
                                                  decode_rows_and_chunks)
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS, KernelRope

_BF16 = torch.bfloat16
THREADED_KEYS = 16384  # keys a step's attention reads before its rows are shared among threads


def _rows(t: torch.Tensor, dtypes=(torch.float32, _BF16)) -> bool:
    """A 2-D CPU tensor of whole rows (unit stride along the row) in one of ``dtypes``."""
    return t.device.type == "cpu" and t.dim() == 2 and t.dtype in dtypes and t.stride(1) == 1


class CpuLayerOps:
    """``TorchLayerOps``' interface over ``csrc/layers.c``."""

    def __init__(self, lib: ctypes.PyDLL, act_dtype: torch.dtype, final_norm):
        self.lib, self.act_dtype, self.final_norm = lib, act_dtype, final_norm
        self.num_fallbacks = 0  # calls that took the reference (tests check the kernels ran)

    def rope_inputs(self, model, positions: torch.Tensor) -> KernelRope:
        return KernelRope(model, positions)

    def _out_dtype(self, norm, x: torch.Tensor) -> torch.dtype:
        return x.dtype if norm is self.final_norm else self.act_dtype  # the LM head refines from fp32

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        if not (_rows(x, (torch.float32,)) and x.is_contiguous() and norm.weight.dtype == torch.float32):
            self.num_fallbacks += 1
            return TORCH_LAYER_OPS.rms_norm(x, norm)
        residual = x.clone()  # the kernel writes its input: a norm alone must leave x as it was
        return self._norm(None, residual, norm)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual is updated in place (the layer owns it: the embedding output or an earlier sum)."""
        if not (_rows(x) and _rows(residual, (torch.float32,)) and norm.weight.dtype == torch.float32
                and x.shape == residual.shape):
            self.num_fallbacks += 1
            return TORCH_LAYER_OPS.add_rms_norm(x.to(residual.dtype), residual, norm)
        return residual, self._norm(x, residual, norm)

    def _norm(self, x: torch.Tensor | None, residual: torch.Tensor, norm) -> torch.Tensor:
        n, d = residual.shape
        out = torch.empty((n, d), dtype=self._out_dtype(norm, residual))
        weight = norm.weight.contiguous()  # (held while the kernel reads it)
        self.lib.folio_add_rms_norm(n, d, None if x is None else x.data_ptr(), 0 if x is None else x.stride(0),
                                    int(x is not None and x.dtype == _BF16), residual.data_ptr(), residual.stride(0),
                                    weight.data_ptr(), norm.eps, out.data_ptr(), d, int(out.dtype == _BF16))
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 d] -> [n, d]
        return self._gated(gate_up, self.lib.folio_silu_and_mul, TORCH_LAYER_OPS.silu_and_mul)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2 d] -> [n, d]
        """GeGLU (Gemma): tanh-approximated GELU of the gate times up."""
        return self._gated(gate_up, self.lib.folio_gelu_tanh_and_mul, TORCH_LAYER_OPS.gelu_tanh_and_mul)

    def _gated(self, gate_up: torch.Tensor, kernel, reference) -> torch.Tensor:
        if not _rows(gate_up):
            self.num_fallbacks += 1
            return reference(gate_up)
        n, d = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((n, d), dtype=self.act_dtype)
        kernel(n, d, gate_up.data_ptr(), gate_up.stride(0), int(gate_up.dtype == _BF16), out.data_ptr(), d,
               int(out.dtype == _BF16))
        return out

    def rope_write_kv(self, qkv: torch.Tensor, attn, rope: KernelRope, k_cache, v_cache, meta, backend) -> torch.Tensor:
        slots, positions = meta.slot_mapping, rope.positions
        if not (_rows(qkv) and attn.kv_rotation is None and k_cache.dtype == torch.float32
                and v_cache.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
                and rope.cos_table.dtype == torch.float32 and rope.cos_table.is_contiguous()
                and rope.sin_table.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()
                and positions.dtype == torch.int64 and positions.is_contiguous()):
            self.num_fallbacks += 1
            return TORCH_LAYER_OPS.rope_write_kv(qkv.to(rope.cos_table.dtype), attn, rope.reference(), k_cache,
                                                 v_cache, meta, backend)
        n = qkv.shape[0]
        q = torch.empty((n, attn.num_heads, attn.head_dim), dtype=torch.float32)
        self.lib.folio_rope_write_kv(n, qkv.data_ptr(), qkv.stride(0), int(qkv.dtype == _BF16), positions.data_ptr(),
                                     rope.cos_table.data_ptr(), rope.sin_table.data_ptr(), slots.data_ptr(),
                                     attn.num_heads, attn.num_kv_heads, attn.head_dim, q.data_ptr(),
                                     k_cache.data_ptr(), v_cache.data_ptr())
        return q


class _CpuPlan(_TorchPlan):
    """The torch plan's chunks, and the decode rows as arrays for the kernel."""

    def __init__(self, meta, max_row_chunk: int):
        rows, chunks = decode_rows_and_chunks(meta, max_row_chunk)
        super().__init__(decode=None, chunks=chunks, write_idx=_write_idx(meta))
        self.tok = None
        if rows:
            cols = np.array(rows, dtype=np.int64).T
            self.tok, self.seq, self.lens = (np.ascontiguousarray(c) for c in cols)
            self.max_len = int(self.lens.max())
            self.num_keys = int(self.lens.sum())  # keys read per KV head (windows aside)
        self.block_tables = meta.block_tables.contiguous()
        if rows:  # the kernel's row arguments, the same for every layer
            self.row_args = (len(rows), self.tok.ctypes.data, self.seq.ctypes.data)
            self.table_args = (self.block_tables.data_ptr(), self.block_tables.stride(0), self.lens.ctypes.data)


class DecodeStack:
    """``csrc/stack.c``: every decoder layer of a step in one call, when each token of the step is
    attended row by row and the model's layers are plain (``model.stack_layout``, see stack.c). The
    same kernels run, in the same order and dtypes, as through the modules: the bits are the same,
    the Python between them is gone. ``__call__`` returns None when the step or the model does not
    qualify; the caller then runs the modules."""

    def __init__(self, lib: ctypes.PyDLL, act_dtype: torch.dtype):
        self.lib, self.act = lib, act_dtype  # between the layers' operations: fp32 or bf16
        self._dims = np.zeros(12, dtype=np.int64)
        self._bufs: dict[str, torch.Tensor] = {}
        self._buf_ptrs = (ctypes.c_void_p * 9)()
        self.num_calls = 0  # steps it ran (tests check it does)

    def _workspace(self, n: int, scratch: int) -> None:
        d = self._dims
        hidden, q_size, kv_size, inter = (int(v) for v in d[:4])
        act = self.act
        shapes = {"normed": (hidden, act), "qkv": (q_size + 2 * kv_size, act), "q": (q_size, torch.float32),
                  "attn": (q_size, torch.float32), "h": (hidden, torch.float32), "gate_up": (2 * inter, act),
                  "act": (inter, act), "down": (hidden, act)}
        if not self._bufs or self._bufs["normed"].shape[0] < n or self._bufs["normed"].dtype != act:
            rows = max(n, 2 * self._bufs["normed"].shape[0] if self._bufs else 8)
            for name, (width, dtype) in shapes.items():
                self._bufs[name] = torch.empty((rows, width), dtype=dtype)
        if "scratch" not in self._bufs or self._bufs["scratch"].numel() < scratch:
            self._bufs["scratch"] = torch.empty(max(scratch, 2 * self._bufs.get("scratch", torch.empty(0)).numel()))
        for i, name in enumerate((*shapes, "scratch")):
            self._buf_ptrs[i] = self._bufs[name].data_ptr()

    def __call__(self, model, residual: torch.Tensor, positions: torch.Tensor, kv_caches, meta, plan):
        if plan.chunks or plan.tok is None or len(plan.tok) != residual.shape[0]:
            return None
        layout = model.stack_layout(kv_caches)  # None: the model's layers are not plain
        if layout is None or residual.dtype != torch.float32 or not residual.is_contiguous() \
                or positions.dtype != torch.int64 or meta.slot_mapping.dtype != torch.int64:
            return None
        self._dims[:8] = layout.dims
        n = residual.shape[0]
        threads = torch.get_num_threads()
        group = int(self._dims[4] // self._dims[5])
        stride = group * plan.max_len
        self._dims[8], self._dims[9], self._dims[10] = plan.block_tables.stride(0), threads, stride
        self._dims[11] = int(self.act == _BF16)
        self._workspace(n, threads * stride)
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        out = torch.empty_like(residual)
        taps = None
        if model.taps:  # a draft head reads these layers' residuals (``CausalLM.taps``)
            by_layer = {i: torch.empty_like(residual) for i in model.taps}
            model.tapped = [by_layer[i] for i in model.taps]
            taps = (ctypes.c_void_p * len(layout.table))()
            for i, t in by_layer.items():
                taps[i] = t.data_ptr()
        self.lib.folio_decode_stack(len(layout.table), layout.table.ctypes.data, self._dims.ctypes.data, layout.eps,
                                    layout.scale, layout.softcap, n, residual.data_ptr(), layout.first_norm.data_ptr(),
                                    positions.data_ptr(), model.rope_cos.data_ptr(), model.rope_sin.data_ptr(),
                                    slots.data_ptr(), len(plan.tok), plan.tok.ctypes.data, plan.seq.ctypes.data,
                                    plan.lens.ctypes.data, plan.block_tables.data_ptr(), self._buf_ptrs,
                                    out.data_ptr(), taps)
        self.num_calls += 1
        return out


class CpuKernelBackend(TorchAttentionBackend):
    """The torch backend with decode attention (and the layer operations) in ``csrc/layers.c``.
    ``batch_invariant``: every token, prefill chunks' included, is attended by the decode kernel."""

    name = "cpu"

    def __init__(self, lib: ctypes.PyDLL, act_dtype: torch.dtype, final_norm, batch_invariant: bool = False):
        self.lib = lib
        self.batch_invariant = batch_invariant
        self.max_row_chunk = sys.maxsize if batch_invariant else SHORT_CHUNK_ROWS
        self.layer_ops = CpuLayerOps(lib, act_dtype, final_norm)
        self.stack = DecodeStack(lib, act_dtype)
        self._scratch = np.empty(0, dtype=np.float32)
        self._scratch_ptr = self._scratch.ctypes.data

    def plan(self, meta) -> _TorchPlan:
        if not isinstance(meta.plan, _CpuPlan):
            meta.plan = _CpuPlan(meta, self.max_row_chunk)
        return meta.plan

    def decode_stack(self, model, residual, positions, kv_caches, meta) -> torch.Tensor | None:
        """The whole layer stack in one C call (``DecodeStack``), or None: run the modules."""
        if self.stack is None or model.rope_cos.dtype != torch.float32 or self.stack.act != self.layer_ops.act_dtype:
            return None
        return self.stack(model, residual, positions, kv_caches, meta, self.plan(meta))

    def _attend_decode(self, out, query, k_cache, v_cache, plan, scale, kv_scales, window=0, softcap=0.0) -> None:
        if plan.tok is None:
            return
        # make_cpu_backend took an fp32 model and pool (contiguous, as KVPool allocates it); either
        # RoPE path gives a contiguous fp32 query
        num_heads, num_kv_heads, head_dim = query.shape[1], k_cache.shape[2], k_cache.shape[3]
        need = (num_heads // num_kv_heads) * plan.max_len
        # a step that reads many keys (a prefill attended row by row, long contexts) shares its rows
        # among the torch threads, idle meanwhile; each row stays whole on one thread
        threads = torch.get_num_threads() if plan.num_keys >= THREADED_KEYS else 1
        if len(self._scratch) < threads * need:
            self._scratch = np.empty(max(threads * need, 2 * len(self._scratch)), dtype=np.float32)
            self._scratch_ptr = self._scratch.ctypes.data
        args = (query.data_ptr(), *plan.table_args, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
                num_heads, num_kv_heads, head_dim, scale, window, softcap, out.data_ptr(), self._scratch_ptr)
        if threads > 1:
            self.lib.folio_decode_attention_threads(threads, need, *plan.row_args, *args)
        else:
            self.lib.folio_decode_attention(*plan.row_args, *args)


def make_cpu_backend(model, model_dtype: torch.dtype, kv_dtype: torch.dtype | None,
                     act_dtype: torch.dtype, batch_invariant: bool = False) -> CpuKernelBackend | None:
    """The kernel backend for ``model``, or None when it would not run its kernels (a model or
    pool in another dtype than fp32) or they cannot be built here."""
    if model_dtype != torch.float32 or (kv_dtype or model_dtype) != torch.float32:
        return None
    lib = cpu_kernels.library()
    return None if lib is None else CpuKernelBackend(lib, act_dtype, model.norm, batch_invariant)

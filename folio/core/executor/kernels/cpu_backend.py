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
        if weight.numel() != d:
            raise ValueError(f"a norm of {weight.numel()} weights for rows of {d}")
        cpu_kernels.check(self.lib, self.lib.folio_add_rms_norm(
            n, d, None if x is None else x.data_ptr(), 0 if x is None else x.stride(0),
            int(x is not None and x.dtype == _BF16), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
            norm.eps, out.data_ptr(), d, int(out.dtype == _BF16)))
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
        cpu_kernels.check(self.lib, kernel(n, d, gate_up.data_ptr(), gate_up.stride(0), int(gate_up.dtype == _BF16),
                                           out.data_ptr(), d, int(out.dtype == _BF16)))
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
        if positions.numel() != n or slots.numel() != n or rope.sin_table.shape != rope.cos_table.shape \
                or rope.cos_table.shape[1] != attn.head_dim:
            raise ValueError(f"{n} tokens with {positions.numel()} positions, {slots.numel()} slots")
        q = torch.empty((n, attn.num_heads, attn.head_dim), dtype=torch.float32)
        cpu_kernels.check(self.lib, self.lib.folio_rope_write_kv(
            n, qkv.data_ptr(), qkv.stride(0), int(qkv.dtype == _BF16), positions.data_ptr(), rope.cos_table.data_ptr(),
            rope.sin_table.data_ptr(), rope.cos_table.shape[0], slots.data_ptr(), attn.num_heads, kv_struct(k_cache, v_cache),
            q.data_ptr()))
        return q


def kv_struct(k_cache: torch.Tensor, v_cache: torch.Tensor) -> cpu_kernels.KV:
    """folio.h's ``folio_kv`` of one layer's pool (fp32, contiguous, [blocks, block_size, heads, dim])."""
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"a KV pool of shapes {list(k_cache.shape)} and {list(v_cache.shape)}")
    return cpu_kernels.KV(k=k_cache.data_ptr(), v=v_cache.data_ptr(), num_blocks=k_cache.shape[0],
                          block_size=k_cache.shape[1], num_kv_heads=k_cache.shape[2], head_dim=k_cache.shape[3])


class _CpuPlan(_TorchPlan):
    """The torch plan's chunks, and the decode rows as folio.h's ``folio_rows`` for the kernels."""

    def __init__(self, meta, max_row_chunk: int):
        rows, chunks = decode_rows_and_chunks(meta, max_row_chunk)
        super().__init__(decode=None, chunks=chunks, write_idx=_write_idx(meta))
        self.tok = None
        self.block_tables = meta.block_tables.to(torch.int32).contiguous()
        if rows:
            cols = np.array([r[:3] for r in rows], dtype=np.int64).T
            self.tok, self.seq, self.lens = (np.ascontiguousarray(c) for c in cols)
            # tree rows: their ancestors' keys after the context (folio_rows.extra); None when no row has any
            self.extra = np.array([r[3] for r in rows], dtype=np.uint64) if any(r[3] for r in rows) else None
            # rows inside an image that attends both ways: their windows end before their keys do
            self.window_ends = np.array([r[4] for r in rows], dtype=np.int64) \
                if any(r[4] != r[2] for r in rows) else None
            keys = self.lens + (0 if self.extra is None else np.array([r[3].bit_count() for r in rows]))
            self.max_len = int(keys.max())
            self.num_keys = int(keys.sum())  # keys read per KV head (windows aside)
            bt = self.block_tables
            self.rows = cpu_kernels.Rows(m=len(rows), tok=self.tok.ctypes.data, seq=self.seq.ctypes.data,
                                         lens=self.lens.ctypes.data, block_tables=bt.data_ptr(), num_seqs=bt.shape[0],
                                         max_blocks=bt.shape[1],
                                         extra=None if self.extra is None else self.extra.ctypes.data,
                                         window_ends=None if self.window_ends is None else self.window_ends.ctypes.data)


class DecodeStack:
    """``csrc/stack.c``: every decoder layer of a step in one call, when each token of the step is
    attended row by row and the model's layers are plain (``model.stack_layout``, see stack.c). The
    same kernels run, in the same order and dtypes, as through the modules: the bits are the same,
    the Python between them is gone. ``__call__`` returns None when the step or the model does not
    qualify; the caller then runs the modules."""

    def __init__(self, lib: ctypes.PyDLL, act_dtype: torch.dtype):
        self.lib, self.act = lib, act_dtype  # between the layers' operations: fp32 or bf16
        self._work = torch.empty(0, dtype=torch.uint8)
        self.num_calls = 0  # steps it ran (tests check it does)
        self.profile: np.ndarray | None = None  # int64 [len(STACK_PARTS)]: each part's ns are added (a benchmark's)

    def __call__(self, model, residual: torch.Tensor, positions: torch.Tensor, kv_caches, meta, plan):
        if plan.chunks or plan.tok is None or len(plan.tok) != residual.shape[0]:
            return None
        layout = model.stack_layout(kv_caches)  # None: the model's layers are not plain
        if layout is None or residual.dtype != torch.float32 or not residual.is_contiguous() \
                or positions.dtype != torch.int64 or meta.slot_mapping.dtype != torch.int64:
            return None
        stack = layout.stack
        stack.act_bf16, stack.threads = int(self.act == _BF16), torch.get_num_threads()
        stack.profile_ns = None if self.profile is None else self.profile.ctypes.data
        if self.lib.folio_threads() != stack.threads:  # the GEMMs' pool: the torch threads, as QGemm sets it
            self.lib.folio_set_threads(stack.threads)
        n = residual.shape[0]
        ref = ctypes.byref(stack)
        need = self.lib.folio_stack_work_bytes(ref, n, plan.max_len)
        cpu_kernels.check(self.lib, min(need, 0))
        if self._work.numel() < need:
            self._work = torch.empty(max(need, 2 * self._work.numel()), dtype=torch.uint8)
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        out = torch.empty_like(residual)
        taps = None
        if model.taps:  # a draft head reads these layers' residuals (``CausalLM.taps``)
            by_layer = {i: torch.empty_like(residual) for i in model.taps}
            model.tapped = [by_layer[i] for i in model.taps]
            taps = (ctypes.c_void_p * stack.num_layers)()
            for i, t in by_layer.items():
                taps[i] = t.data_ptr()
        step = cpu_kernels.Step(n=n, residual=residual.data_ptr(), positions=positions.data_ptr(),
                                slots=slots.data_ptr(), rows=plan.rows, out=out.data_ptr(), work=self._work.data_ptr(),
                                work_bytes=self._work.numel(), taps=None if taps is None else ctypes.addressof(taps))
        cpu_kernels.check(self.lib, self.lib.folio_decode_stack(ref, ctypes.byref(step)))
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
        num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
        need = self.lib.folio_attention_scratch(num_heads // num_kv_heads, plan.max_len)
        # a step that reads many keys (a prefill attended row by row, long contexts) shares its rows
        # among the threads, idle meanwhile; each (row, head) pair stays whole on one thread
        threads = torch.get_num_threads() if plan.num_keys >= THREADED_KEYS else 1
        if len(self._scratch) < threads * need:
            self._scratch = np.empty(max(threads * need, 2 * len(self._scratch)), dtype=np.float32)
        cpu_kernels.check(self.lib, self.lib.folio_decode_attention(
            ctypes.byref(plan.rows), query.data_ptr(), query.shape[0], num_heads, kv_struct(k_cache, v_cache), scale,
            window, softcap, out.data_ptr(), self._scratch.ctypes.data, need, threads))


def make_cpu_backend(model, model_dtype: torch.dtype, kv_dtype: torch.dtype | None,
                     act_dtype: torch.dtype, batch_invariant: bool = False) -> CpuKernelBackend | None:
    """The kernel backend for ``model``, or None when it would not run its kernels (a model or
    pool in another dtype than fp32) or they cannot be built here."""
    if model_dtype != torch.float32 or (kv_dtype or model_dtype) != torch.float32:
        return None
    lib = cpu_kernels.library()
    return None if lib is None else CpuKernelBackend(lib, act_dtype, model.norm, batch_invariant)

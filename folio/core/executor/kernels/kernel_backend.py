"""The kernel attention backend, independent of how its kernels get launched.

Same methods as ``TorchAttentionBackend`` (``plan``, ``write_kv``, ``attend``, ``copy_blocks``) plus
``swap_out``/``swap_in``, implemented by launching the kernels of ``cuda/`` through a *launcher*
(swaps are asynchronous torch copies, one per run of consecutive blocks):
on a GPU the CuPy launcher of ``cuda_backend`` (torch's current stream, raw device pointers); in
the tests the CPU emulation (tests/cuda), which runs the same kernel sources on CPU tensors. All
planning and argument marshalling lives here, so the emulation exercises it too.

A launcher provides ``launch(names, kernel, grid, block, args, device)`` (``kernel`` is a field of
``KernelNames``; ``args`` are numpy scalars in the kernel's parameter order, pointers as uint64)
and ``num_sms``. ``batch_invariant=True`` makes every plan batch-invariant (``kernel_plan``: a
token's attention output does not depend on the batch, its chunk, prefill or decode). Every launch keeps within CUDA's grid limits (x < 2^31, y and z <= 65535), for
any batch the scheduler can form: the count that grows with the batch (work items) goes along x.
"""

from __future__ import annotations

import numpy as np
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.attention import AttentionMetadata, attention_options
from folio.core.executor.kernels.kv_quant import FP8_DTYPE, DeviceScales, scales_key
from folio.core.executor.kernels.kernel_plan import KernelPlan, PathPlan, build_plan, work_items  # noqa: F401 (re-export)
from folio.core.executor.kernels.layer_ops import KernelLayerOps

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _ptr(tensor: torch.Tensor) -> np.uint64:
    return np.uint64(tensor.data_ptr())


class KernelAttentionBackend:
    name = "cuda"

    def __init__(self, launcher, model_dtype: torch.dtype, split: bool | None = None,
                 partition_size: int = 512, kv_dtype: torch.dtype | None = None, batch_invariant: bool = False):
        if model_dtype not in DTYPE_NAMES:
            raise ck.UnsupportedKernelError(f"no CUDA kernels for dtype {model_dtype}; built: {list(DTYPE_NAMES)}")
        self.fp8 = kv_dtype == FP8_DTYPE  # an e4m3 pool: its kernels take the layer's K/V scales
        if self.fp8 and DTYPE_NAMES[model_dtype] not in ck.FP8_ACTIVATION_DTYPES:
            raise ck.UnsupportedKernelError(
                f"no CUDA kernels for {model_dtype} activations over an fp8 KV pool (built: "
                f"{', '.join(ck.FP8_ACTIVATION_DTYPES)}); use --dtype bfloat16 or --attention-backend torch")
        self.launcher = launcher
        self.model_dtype = model_dtype
        self.split = split  # None: decide per step; True/False: force (tests, benchmarks)
        self.partition_size = partition_size  # keys per split when forced, and the chunk kernel's
        # every plan batch-invariant (kernel_plan): one kernel, fixed partitions of partition_size keys
        self.batch_invariant = batch_invariant
        self._address_tables: dict[tuple, torch.Tensor] = {}
        self._scales = DeviceScales()  # fp8 scales as the kernels read them
        self.layer_ops = KernelLayerOps(launcher)  # the fused kernels of cuda/fused_ops.cu

    # ------------------------------------------------------------------ planning
    def names(self, dtype: torch.dtype, head_size: int, block_size: int, cache_dtype: torch.dtype | None = None
              ) -> ck.KernelNames:
        """Instances for activations of ``dtype`` over a pool of ``cache_dtype`` (default: the same)."""
        if dtype not in DTYPE_NAMES:
            raise ck.UnsupportedKernelError(f"no CUDA kernels for dtype {dtype}; built: {list(DTYPE_NAMES)}")
        return ck.kernel_names(DTYPE_NAMES[dtype], head_size, block_size, cache_dtype == FP8_DTYPE)

    def plan(self, meta: AttentionMetadata, group: int = 1, num_kv_heads: int = 1, fp8: bool | None = None,
             window: int = 0) -> KernelPlan:
        """The step's plan for this GQA shape over this backend's pool (``fp8``: over an fp8 pool or
        not, when a draft model's pool differs), built once and cached on the metadata. A
        sliding-window layer's plan (``window`` > 0) reuses the full-context plan's item tensors
        and sizes its splits by the keys inside the window."""
        plans = meta.plan if isinstance(meta.plan, dict) else {}
        meta.plan = plans
        fp8 = self.fp8 if fp8 is None else fp8
        key = (group, num_kv_heads, fp8) + ((window,) if window > 0 else ())
        if key not in plans:
            base = self.plan(meta, group, num_kv_heads, fp8) if window > 0 else None
            tensor_cores = DTYPE_NAMES[self.model_dtype] in ck.TENSOR_CORE_DTYPES and not fp8
            rows = ck.PREFILL_ROWS if tensor_cores else ck.ATTN_ROWS
            plans[key] = build_plan(meta, group, num_kv_heads, self.launcher.num_sms, self.split, self.partition_size,
                                    rows, window=window, like=base, invariant=self.batch_invariant)
        return plans[key]

    # ------------------------------------------------------------------ per layer
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, kv_scales=(1.0, 1.0)) -> None:
        """``TorchAttentionBackend.write_kv`` on the CUDA kernels (``key`` and ``value`` of any token
        and head strides)."""
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        act = self.model_dtype if k_cache.dtype == FP8_DTYPE else k_cache.dtype
        names = self.names(act, head_dim, meta.block_size, k_cache.dtype)
        key, value = (_dim_contiguous(t.to(act)) for t in (key, value))
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        args = (
            _ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slots),
            np.int32(num_kv_heads), np.int32(head_dim),
            np.int64(key.stride(0)), np.int64(key.stride(1)), np.int64(value.stride(0)), np.int64(value.stride(1)),
            *self._scale_args(k_cache, kv_scales, with_shift=True),
        )
        self.launcher.launch(names, "write_kv", (num_tokens, 1, 1), (ck.WRITE_THREADS, 1, 1), args, key.device)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales=(1.0, 1.0), window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """``TorchAttentionBackend.attend`` on the CUDA kernels: the same arguments, the same result."""
        num_tokens, num_heads, head_dim = query.shape
        window, softcap = attention_options(window, softcap)
        num_kv_heads = k_cache.shape[2]
        if query.dtype != k_cache.dtype and k_cache.dtype != FP8_DTYPE:
            raise ValueError(f"query dtype {query.dtype} differs from the KV pool's {k_cache.dtype}")
        if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the kernels read K/V rows as 16-byte vectors: pools must be contiguous and 16-byte aligned")
        names = self.names(query.dtype, head_dim, meta.block_size, k_cache.dtype)
        plan = self.plan(meta, num_heads // num_kv_heads, num_kv_heads, k_cache.dtype == FP8_DTYPE, window)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
        # the decode kernel reads q as 16-byte vectors: heads contiguous, rows 16-byte aligned
        if query.stride(2) != 1 or query.stride(1) != head_dim or (query.stride(0) * query.element_size()) % 16 \
                or query.data_ptr() % 16:
            query = query.contiguous()
        out_ptr, query_ptr = _ptr(out), _ptr(query)
        chunk_kernel = "prefill" if names.prefill else "attention"  # tensor cores for 16-bit types
        for kernel, path in ((chunk_kernel, plan.chunk), ("decode", plan.decode)):
            if path is None:
                continue
            tail, part_ptrs = self._path_args(path, meta, k_cache, v_cache, query, scale, num_heads, head_dim,
                                              kv_scales, window, softcap)
            args = (out_ptr, *part_ptrs, query_ptr, *tail)
            if kernel == "decode":  # one CTA per (sequence, split) along x, KV heads along y
                grid, block = (path.num_items * path.num_splits, num_kv_heads, 1), ck.DECODE_THREADS
            else:  # work items along x, KV heads along y, partitions along z
                grid = (path.num_items, num_kv_heads, path.num_splits)
                block = ck.PREFILL_THREADS if kernel == "prefill" else ck.ATTN_THREADS
            self.launcher.launch(names, kernel, grid, (block, 1, 1), args, query.device)
            if path.num_splits > 1:
                args = (out_ptr, *part_ptrs, _ptr(path.tokens), np.int32(num_heads), np.int32(path.num_splits),
                        np.int32(head_dim))
                self.launcher.launch(names, "reduce", (path.num_tokens * num_heads, 1, 1), (ck.REDUCE_THREADS, 1, 1),
                                     args, query.device)
        return out

    def _path_args(self, path: PathPlan, meta, k_cache, v_cache, query, scale: float, num_heads: int, head_dim: int,
                   kv_scales, window: int = 0, softcap: float = 0.0):
        """The launch arguments after the query pointer, and the partials' pointers: the same for
        every call of a step on one layer, so they are built once per (step, layer) (numpy scalars
        cost microseconds each, and a step calls attend once per layer)."""
        key = (k_cache.data_ptr(), v_cache.data_ptr(), query.stride(0), scale, query.shape[0], scales_key(kv_scales),
               window, softcap)
        if key not in path.arg_cache:
            part_out, part_lse = self._partials(path, query.shape[0], num_heads, head_dim, query.device)
            tail = (_ptr(k_cache), _ptr(v_cache), _ptr(_int32(meta.block_tables)), _ptr(_int32(meta.seq_lens)),
                    _ptr(_int32(meta.query_start_loc)), _ptr(path.items), np.int32(k_cache.shape[2]),
                    np.int32(num_heads // k_cache.shape[2]), np.int32(meta.block_tables.shape[1]),
                    np.int64(query.stride(0)), np.float32(scale), np.int32(path.num_splits),
                    np.int32(path.split_size), *self._scale_args(k_cache, kv_scales), *_softcap_args(window, softcap))
            path.arg_cache[key] = (tail, (_ptr(part_out), _ptr(part_lse)))
        return path.arg_cache[key]

    def _scale_args(self, k_cache: torch.Tensor, kv_scales, with_shift: bool = False) -> tuple[np.uint64, ...]:
        """The kernels' (k_scale, v_scale[, k_shift]) pointers (``kv_quant.DeviceScales``)."""
        return tuple(np.uint64(p) for p in self._scales.pointers(k_cache, kv_scales, with_shift))

    @staticmethod
    def _partials(path: PathPlan, num_tokens: int, num_heads: int, head_dim: int, device):
        """fp32 partial outputs and log-sum-exps of a split path, indexed by token, allocated once
        per step (layers run in order on one stream, so they share them). Unsplit launches get a
        1-element placeholder."""
        shape = (num_tokens, num_heads, path.num_splits)
        if path.partials is None or path.partials[1].shape != shape:
            if path.num_splits == 1:
                dummy = torch.empty(1, dtype=torch.float32, device=device)
                path.partials = (dummy, dummy)
            else:
                path.partials = (torch.empty(shape + (head_dim,), dtype=torch.float32, device=device),
                                 torch.empty(shape, dtype=torch.float32, device=device))
        return path.partials

    # ------------------------------------------------------------------ whole blocks
    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer (one launch)."""
        self._copy(kv_caches, kv_caches, pairs)

    def swap_out(self, kv_caches, host_caches, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: device pool -> pinned host pool, every layer."""
        _copy_block_runs(kv_caches, host_caches, pairs)

    def swap_in(self, host_caches, kv_caches, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: pinned host pool -> device pool, every layer."""
        _copy_block_runs(host_caches, kv_caches, pairs)

    def _copy(self, src_caches, dst_caches, pairs) -> None:
        if not pairs:
            return
        k0 = src_caches[0][0]
        _check_same_blocks(src_caches, dst_caches)
        device = k0.device
        block_bytes = k0[0].numel() * k0.element_size()
        if block_bytes % 16:
            raise ValueError(f"a KV block of {block_bytes} bytes is not a whole number of 16-byte words")
        src = self._addresses(src_caches, device)
        dst = self._addresses(dst_caches, device)
        pair_t = torch.tensor(pairs, dtype=torch.int64).to(device)
        names = ck.KernelNames("", "", "", "", "", ck.COPY_BLOCKS_NAME)
        args = (_ptr(src), _ptr(dst), _ptr(pair_t), np.int64(block_bytes // 16))
        grid = (len(pairs), 2 * len(src_caches), 1)
        self.launcher.launch(names, "copy_blocks", grid, (ck.COPY_THREADS, 1, 1), args, device)

    def _addresses(self, caches, device) -> torch.Tensor:
        """[2 * num_layers] int64 base addresses (K then V per layer), cached per pool."""
        key = tuple(t.data_ptr() for kv in caches for t in kv) + (str(device),)
        if key not in self._address_tables:
            addrs = [t.data_ptr() for kv in caches for t in kv]
            self._address_tables[key] = torch.tensor(addrs, dtype=torch.int64).to(device)
        return self._address_tables[key]


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source, first destination, length) of the maximal runs of pairs whose source and
    destination blocks both advance by one: each run is one contiguous copy per cache."""
    runs: list[list[int]] = []
    for src, dst in sorted(pairs):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


def _check_same_blocks(src_caches, dst_caches) -> None:
    k0 = src_caches[0][0]
    tensors = [t for kv in (*src_caches, *dst_caches) for t in kv]
    if len(src_caches) != len(dst_caches) or any(t.shape[1:] != k0.shape[1:] or t.dtype != k0.dtype
                                                  for t in tensors):
        raise ValueError("source and destination pools differ in layers, block shape or dtype")


def _copy_block_runs(src_caches, dst_caches, pairs: list[tuple[int, int]]) -> None:
    """Swap between the device pool and the pinned host pool: one asynchronous copy (DMA, on
    torch's current stream) per run of consecutive blocks, per layer, K and V. A host pool that
    is not pinned still works, synchronously."""
    if not pairs:
        return
    _check_same_blocks(src_caches, dst_caches)
    runs = block_runs(pairs)
    for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
        for src, dst, n in runs:
            dst_k[dst : dst + n].copy_(src_k[src : src + n], non_blocking=True)
            dst_v[dst : dst + n].copy_(src_v[src : src + n], non_blocking=True)


def make_host_pool(kv_caches, num_blocks: int, pin: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A host tier with the device pool's block shape: per layer (k, v) of [num_blocks, ...]."""
    k0 = kv_caches[0][0]
    shape = (num_blocks,) + tuple(k0.shape[1:])
    return [
        (torch.zeros(shape, dtype=k0.dtype, pin_memory=pin), torch.zeros(shape, dtype=k0.dtype, pin_memory=pin))
        for _ in kv_caches
    ]


def _softcap_args(window: int, softcap: float) -> tuple[np.int32, np.float32, np.float32]:
    """The kernels' (window, softcap, 1 / softcap): the reciprocal rounded to fp32 on the host and
    clamped to the largest float, so a tiny cap never multiplies a zero score by infinity."""
    inv = min(1.0 / softcap, float(np.finfo(np.float32).max)) if softcap > 0 else 0.0
    return np.int32(window), np.float32(softcap), np.float32(inv)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Metadata as the kernels read it: contiguous int32 (a no-op for AttentionMetadata.build's)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any token and head strides but need each head's vector contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()

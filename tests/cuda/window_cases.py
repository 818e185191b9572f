"""Sliding-window and soft-cap cases for the attention kernels, shared by the emulated tests and the
GPU tests: a dense oracle written here (explicit fp32 matmuls per sequence, no code shared with a
backend), optionally the torch backend's own ``window``/``softcap`` reference, and K/V poisoning
that proves the kernels never read keys before a window; and the fused GeGLU kernel's case."""

from __future__ import annotations

import inspect
import math

import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.attention import TorchAttentionBackend
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS, KernelLayerOps
from folio.core.executor.kernels.kv_quant import FP8_DTYPE
from tests.cuda.kv_cases import TOLERANCE, Step, fresh_meta


def pool_keys(step: Step, b: int, cache: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Sequence b's K or V rows in position order, fp32 (an fp8 pool dequantized by ``scale``)."""
    s_len = step.meta.seq_lens_list[b]
    rows = cache[step.tables[b]].flatten(0, 1)[:s_len]
    return rows.float() * scale if cache.dtype == FP8_DTYPE else rows.float()


def dense_reference(step: Step, scale: float, window: int = 0, softcap: float = 0.0,
                    kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] fp32: the token at position p attends keys
    p - window < k <= p (all k <= p for window 0); score = scale * q.k, then
    softcap * tanh(score / softcap), then the mask and the softmax, all in fp32."""
    num_heads = step.query.shape[1]
    num_kv_heads = step.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(step.query.shape, dtype=torch.float32)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(step.meta.query_lens_list, step.meta.seq_lens_list)):
        if q_len == 0:
            continue
        k = pool_keys(step, b, step.k_cache, kv_scales[0]).cpu().repeat_interleave(group, dim=1)
        v = pool_keys(step, b, step.v_cache, kv_scales[1]).cpu().repeat_interleave(group, dim=1)
        q = step.query[start : start + q_len].float().cpu()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(s_len - q_len, s_len)[:, None]
        k_pos = torch.arange(s_len)[None, :]
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def torch_reference_takes_windows() -> bool:
    params = inspect.signature(TorchAttentionBackend.attend).parameters
    return "window" in params and "softcap" in params


def torch_reference(step: Step, scale: float, window: int, softcap: float,
                    kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """The torch backend (fp32 copies of q and of a 16-bit pool; an fp8 pool as it is)."""
    fp8 = step.k_cache.dtype == FP8_DTYPE
    k, v = (step.k_cache, step.v_cache) if fp8 else (step.k_cache.float(), step.v_cache.float())
    return TorchAttentionBackend().attend(step.query.float(), k, v, fresh_meta(step), scale, kv_scales,
                                          window=window, softcap=softcap).float().cpu()


def poison_before_windows(step: Step, window: int, rows_per_item: int) -> Step:
    """A copy of the step whose K and V are NaN at every position no CTA of the kernels may read:
    before the window of the first token of each work item (a decode sequence is one item). A
    kernel that read one into its math would return NaN."""
    group = step.query.shape[1] // step.k_cache.shape[2]
    bs = step.k_cache.shape[1]
    slots = []
    for b, (q_len, s_len) in enumerate(zip(step.meta.query_lens_list, step.meta.seq_lens_list)):
        if q_len == 0:
            continue
        ctx = s_len - q_len
        firsts = [ctx] if q_len == 1 else [ctx + row0 // group for row0 in range(0, q_len * group, rows_per_item)]
        first_key = max(0, min(firsts) - window + 1)
        slots += [step.tables[b][p // bs] * bs + p % bs for p in range(first_key)]
    caches = []
    for cache in (step.k_cache, step.v_cache):
        poisoned = cache.clone()
        fp8 = cache.dtype == FP8_DTYPE
        rows = (poisoned.view(torch.uint8) if fp8 else poisoned).flatten(0, 1)  # [slots, kv heads, head dim]
        rows[torch.tensor(slots, dtype=torch.int64, device=cache.device)] = 0x7F if fp8 else math.nan  # e4m3 NaN
        caches.append(poisoned)
    return Step(step.meta, step.query, caches[0], caches[1], step.tables, step.slots)


def check(out: torch.Tensor, step: Step, scale: float, window: int, softcap: float,
          kv_scales: tuple[float, float] = (1.0, 1.0), tol: float | None = None) -> None:
    """The kernel's output against the dense oracle, and against the torch backend when it takes
    windows; no NaN anywhere."""
    tol = TOLERANCE[step.query.dtype] if tol is None else tol
    num_real = sum(step.meta.query_lens_list)
    got = out[:num_real].float().cpu()
    assert not torch.isnan(got).any(), "NaN in the kernel's output"
    want = dense_reference(step, scale, window, softcap, kv_scales)[:num_real]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if torch_reference_takes_windows():
        ref = torch_reference(step, scale, window, softcap, kv_scales)[:num_real]
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def run_attend(make_backend, step: Step, *, window: int = 0, softcap: float = 0.0, split: bool | None = None,
               partition_size: int = 512, scale: float | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
               poison: bool = True) -> tuple[torch.Tensor, float]:
    """The kernel backend's attend (``make_backend(dtype, split=, partition_size=, kv_dtype=)``)
    over the step's pool, poisoned before every window; returns (output, scale)."""
    dtype = step.query.dtype
    backend = make_backend(dtype, split=split, partition_size=partition_size, kv_dtype=step.k_cache.dtype)
    scale = step.query.shape[-1] ** -0.5 if scale is None else scale
    dtype_name = str(dtype).removeprefix("torch.")
    tensor_cores = dtype_name in ck.TENSOR_CORE_DTYPES and step.k_cache.dtype == dtype
    rows = ck.PREFILL_ROWS if tensor_cores else ck.ATTN_ROWS
    run_step = poison_before_windows(step, window, rows) if poison and window > 0 else step
    out = backend.attend(run_step.query, run_step.k_cache, run_step.v_cache, fresh_meta(step), scale, kv_scales,
                         window=window, softcap=softcap)
    return out, scale


def check_gelu_tanh_and_mul(launcher, dtype, device="cpu", num_tokens: int = 3, d: int = 2560, seed: int = 2):
    """GeGLU through the fused kernel against the torch reference, on a strided view, with
    saturated, tiny and zero gates."""
    g = torch.Generator().manual_seed(seed)
    ops = KernelLayerOps(launcher)
    wide = (3.0 * torch.randn(num_tokens, 2 * d + 32, generator=g))
    wide[0, :8] = torch.tensor([0.0, -0.0, 1e4, -1e4, 12.0, -12.0, 1e-6, -3.0])  # saturated tanh, tiny, zeros
    wide = wide.to(dtype).to(device)
    gate_up = wide[:, : 2 * d]  # token stride 2 d + 32
    want = TORCH_LAYER_OPS.gelu_tanh_and_mul(gate_up)
    got = ops.gelu_tanh_and_mul(gate_up)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert ops.num_fallbacks == 0

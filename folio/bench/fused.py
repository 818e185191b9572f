"""The fused layer kernels (cuda/fused_ops.cu) against the torch ops they replace, on a GPU.

The Llama-3.2-1B shape in bf16 (hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head 64)
at 1, 256 and 4,096 tokens: microseconds per call (CUDA events, median of repeated runs) for the
torch reference and the kernel, and the kernel's GB/s (bytes it must read and write) against
the device-to-device copy bandwidth measured in the same run.

    python scripts/bench_fused.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS, KernelLayerOps

HIDDEN, INTER, HEADS, KV_HEADS, HEAD = 2048, 8192, 32, 8, 64
DTYPE = torch.bfloat16


def time_us(fn, repeats: int = 50, device: str = "cuda") -> float:
    """Median microseconds per call: CUDA events on a GPU, the wall clock on the CPU."""
    fn()
    times = []
    if device == "cpu":
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_gbps() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / time_us(lambda: b.copy_(a), 20) / 1e3


def cases(n: int, ops: KernelLayerOps):
    dev = "cuda"
    norm = SimpleNamespace(weight=torch.ones(HIDDEN, dtype=DTYPE, device=dev), eps=1e-5)
    x = torch.randn(n, HIDDEN, dtype=DTYPE, device=dev)
    res = torch.randn(n, HIDDEN, dtype=DTYPE, device=dev)
    gate_up = torch.randn(n, 2 * INTER, dtype=DTYPE, device=dev)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD, dtype=DTYPE, device=dev)
    table = torch.randn(8192, HEAD, dtype=DTYPE, device=dev)
    model = SimpleNamespace(rope_cos=table, rope_sin=table)
    positions = torch.arange(n, dtype=torch.int64, device=dev) % 8192
    blocks = (n + 15) // 16
    k_cache = torch.zeros(blocks, 16, KV_HEADS, HEAD, dtype=DTYPE, device=dev)
    v_cache = torch.zeros_like(k_cache)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
                             query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
                             seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
                             block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev), max_query_len=1,
                             max_seq_len=1, block_size=16, positions=positions, padded=False)
    attn = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD, q_size=HEADS * HEAD,
                           kv_size=KV_HEADS * HEAD, kv_scales=(1.0, 1.0), kv_rotation=None)
    torch_backend = TorchAttentionBackend()
    ref_rope, rope = TORCH_LAYER_OPS.rope_inputs(model, positions), ops.rope_inputs(model, positions)
    el = 2  # bytes per element
    return {
        "add_rms_norm": (lambda: TORCH_LAYER_OPS.add_rms_norm(x, res, norm),
                         lambda: ops.add_rms_norm(x, res, norm), n * HIDDEN * el * 4),
        "silu_and_mul": (lambda: TORCH_LAYER_OPS.silu_and_mul(gate_up), lambda: ops.silu_and_mul(gate_up),
                         n * INTER * el * 3),
        "rope_write_kv": (lambda: TORCH_LAYER_OPS.rope_write_kv(qkv, attn, ref_rope, k_cache, v_cache, meta,
                                                                torch_backend),
                          lambda: ops.rope_write_kv(qkv, attn, rope, k_cache, v_cache, meta, None),
                          n * (HEADS + 2 * KV_HEADS) * HEAD * el * 2 + n * 2 * HEAD * el * 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from folio.core.executor.kernels.cuda_backend import CupyLauncher

    ops = KernelLayerOps(CupyLauncher())
    peak = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: copy {peak:,.0f} GB/s; bf16, Llama-3.2-1B shape")
    print(f"{'kernel':>14} {'tokens':>6} {'torch us':>9} {'fused us':>9} {'speedup':>8} {'GB/s':>7} {'of copy':>8}")
    rows = []
    for n in (1, 256, 4096):
        for name, (ref, fused, nbytes) in cases(n, ops).items():
            t_ref, t_fused = time_us(ref), time_us(fused)
            gbps = nbytes / t_fused / 1e3
            rows.append(dict(kernel=name, tokens=n, torch_us=t_ref, fused_us=t_fused, gbps=gbps))
            print(f"{name:>14} {n:>6} {t_ref:>9.1f} {t_fused:>9.1f} {t_ref / t_fused:>7.2f}x {gbps:>7,.0f} "
                  f"{gbps / peak:>7.0%}", flush=True)
    assert ops.num_fallbacks == 0, "a case took the torch fallback"
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbps": peak, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

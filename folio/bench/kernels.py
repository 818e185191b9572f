"""Kernel figures of the cuda backend on a GPU (run by scripts/gpu_check.sh).

More in docs/modules.md (folio/bench/kernels.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend

DTYPE, BLOCK_SIZE, NUM_KV_HEADS = torch.bfloat16, 16, 8


def time_cuda(fn, warmup: int = 3, iters: int = 20, device: str = "cuda") -> float:
    """Mean seconds per call, timed with CUDA events on the current stream (the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if device == "cpu":
        start_s = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start_s) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def time_graph(fn, reps: int = 20, device: str = "cuda") -> float | None:
    """Mean seconds per call replaying a CUDA graph of `reps` calls: the device time without
    Python's launch overhead (CuPy launches on torch's stream are captured like torch's own).
    None when capture fails, and on the CPU."""
    if device == "cpu":
        return None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # builds the step's plan and partial buffers outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        return time_cuda(graph.replay, warmup=1, iters=5) / reps
    except RuntimeError as exc:
        print(f"  (CUDA graph capture failed, eager times only: {exc})", flush=True)
        return None


def copy_bandwidth(num_bytes: int = 2 << 30, device: str = "cuda") -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters=20, device=device)
    return 2 * num_bytes / seconds  # read + write


def empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def paged_step(query_len: int, context: int, batch: int, head_dim: int, device: str = "cuda"):
    """A pool holding `batch` sequences of `context` tokens, blocks in a random order, and the
    step's metadata (the last `query_len` tokens of each are new)."""
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    tables = torch.randperm(num_blocks).view(batch, blocks_per_seq).tolist()
    meta = AttentionMetadata.build([query_len] * batch, [context] * batch, tables, None, BLOCK_SIZE, device)
    return k_cache, v_cache, meta


def decode_case(backend, batch: int, context: int, head_dim: int, group: int, copy_bps: float,
                device: str = "cuda") -> dict:
    num_heads = NUM_KV_HEADS * group
    k_cache, v_cache, meta = paged_step(1, context, batch, head_dim, device)
    query = torch.randn((batch, num_heads, head_dim), dtype=DTYPE, device=device)
    scale = head_dim**-0.5
    warmup, iters = (3, 20) if device == "cuda" else (1, 1)
    eager_s = time_cuda(lambda: backend.attend(query, k_cache, v_cache, meta, scale), warmup, iters, device)
    paged_s = time_graph(lambda: backend.attend(query, k_cache, v_cache, meta, scale), device=device) or eager_s
    plan = next(iter(meta.plan.values()), None)  # the torch reference plans nothing
    splits = 0 if plan is None else plan.decode.num_splits if plan.decode is not None else plan.chunk.num_splits
    del k_cache, v_cache
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * head_dim * 2
    q = query.unsqueeze(2)  # [batch, heads, 1, dim] against contiguous [batch, kv_heads, len, dim]
    k = torch.randn((batch, NUM_KV_HEADS, context, head_dim), dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    sdpa_s = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), warmup, iters,
                       device)
    gbps = kv_bytes / paged_s / 1e9
    return {"batch": batch, "context": context, "head_dim": head_dim, "group": group, "splits": splits,
            "paged_us": paged_s * 1e6, "eager_us": eager_s * 1e6, "paged_GBps": gbps,
            "copy_fraction": gbps * 1e9 / copy_bps,
            "sdpa_us": sdpa_s * 1e6, "vs_sdpa": paged_s / sdpa_s}


def _sdpa_prefill(q_len: int, cached: int, num_heads: int, head_dim: int, device: str):
    """Contiguous SDPA with the new tokens causal against the cached context (lower-right)."""
    q = torch.randn((1, num_heads, q_len, head_dim), dtype=DTYPE, device=device)
    k = torch.randn((1, NUM_KV_HEADS, cached + q_len, head_dim), dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    if cached == 0:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    group = num_heads // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # the bias takes no GQA
    bias = causal_lower_right(q_len, cached + q_len)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def prefill_case(backend, q_len: int, cached: int, copy_bps: float, device: str = "cuda") -> dict:
    num_heads, head_dim = 32, 128
    k_cache, v_cache, meta = paged_step(q_len, cached + q_len, 1, head_dim, device)
    query = torch.randn((q_len, num_heads, head_dim), dtype=DTYPE, device=device)
    def call():
        return backend.attend(query, k_cache, v_cache, meta, head_dim**-0.5)

    warmup, iters = (3, 10) if device == "cuda" else (1, 1)
    eager_s = time_cuda(call, warmup, iters, device)
    paged_s = time_graph(call, reps=5, device=device) or eager_s
    del k_cache, v_cache
    sdpa_s = time_cuda(_sdpa_prefill(q_len, cached, num_heads, head_dim, device), warmup, iters, device)
    pairs = q_len * cached + q_len * (q_len + 1) / 2  # (query, key) pairs that are visible
    flops = 4 * num_heads * head_dim * pairs  # QK^T and PV, 2 flops per multiply-add
    return {"q_len": q_len, "cached": cached, "paged_us": paged_s * 1e6, "eager_us": eager_s * 1e6,
            "paged_TFLOPs": flops / paged_s / 1e12,
            "sdpa_us": sdpa_s * 1e6, "sdpa_TFLOPs": flops / sdpa_s / 1e12, "vs_sdpa": paged_s / sdpa_s}


def bench_decode(backend, heads, groups, contexts, batches, max_kv_gib: float, copy_bps: float, rows: list,
                 save, device: str = "cuda") -> list[dict]:
    """Appends a row per shape to `rows` and saves after each."""
    shapes = [(h, g, c, b) for h in heads for g in groups for c in contexts for b in batches]
    if device == "cuda":
        shapes.append((64, 4, 136, 256))  # the target: Llama-3.2-1B-shaped decode at B=256
    for head_dim, group, context, batch in shapes:
        if 2 * batch * context * NUM_KV_HEADS * head_dim * 2 / 2**30 > max_kv_gib:
            continue
        r = decode_case(backend, batch, context, head_dim, group, copy_bps, device)
        rows.append(r)
        save()  # a run cut short by a time limit keeps the rows it has
        empty_cache(device)
        print(f"  head {head_dim:3d} gqa {group} B={batch:4d} L={context:6d} splits={r['splits']:3d}  "
              f"paged {r['paged_us']:9.1f} us {r['paged_GBps']:7.0f} GB/s ({100 * r['copy_fraction']:4.1f}% of copy)"
              f"  sdpa {r['sdpa_us']:9.1f} us  paged/sdpa {r['vs_sdpa']:5.2f}", flush=True)
    return rows


def bench_prefill(backend, copy_bps: float, rows: list, save, device: str = "cuda") -> list[dict]:
    """Appends a row per chunk to `rows` and saves after each."""
    chunks = (512, 2048) if device == "cuda" else (16,)
    for q_len in chunks:
        for cached in (0, 4096) if device == "cuda" else (0, q_len):
            r = prefill_case(backend, q_len, cached, copy_bps, device)
            rows.append(r)
            save()
            empty_cache(device)
            print(f"  chunk {q_len:5d} after {cached:5d}: paged {r['paged_us']:9.1f} us {r['paged_TFLOPs']:6.1f} TFLOP/s"
                  f"  sdpa {r['sdpa_us']:9.1f} us {r['sdpa_TFLOPs']:6.1f} TFLOP/s  paged/sdpa {r['vs_sdpa']:5.2f}",
                  flush=True)
    return rows


def bench_e2e(num_prompts: int, prompt_len: int, max_tokens: int) -> dict:
    from folio.core.engine import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.sampling import SamplingParams
    from folio.testing.models import write_tiny_model

    folder = tempfile.mkdtemp(prefix="folio-bench-model-")
    write_tiny_model(folder, vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (prompt_len,), generator=gen).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    result = {}
    for name in ("torch", "cuda"):
        blocks = num_prompts * math.ceil((prompt_len + max_tokens) / 16) + 8
        config = RuntimeConfig(device="cuda", dtype="bfloat16", num_kv_blocks=blocks, block_size=16,
                               attention_backend=name)
        runner = ModelRunner(config, folder)
        generate(runner, prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm up, compile
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = generate(runner, prompts, params, max_num_batched_tokens=512)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        result[name] = {"tokens_per_s": sum(map(len, outputs)) / seconds, "seconds": seconds}
        print(f"  {name:5s}: {result[name]['tokens_per_s']:9.1f} generated tokens/s ({seconds:.1f} s)", flush=True)
        del runner
        torch.cuda.empty_cache()
    return result


def others_cpu_share(start_cpu: dict, seconds: float) -> float:
    """Share of all cores that processes other than this one used while the benchmark ran."""
    me = psutil.Process()
    total = psutil.cpu_times()
    busy = (total.user + total.system) - (start_cpu["all"].user + start_cpu["all"].system)
    mine = sum(me.cpu_times()[:2]) - start_cpu["mine"]
    return max(0.0, busy - mine) / (seconds * psutil.cpu_count())


def main(argv: list[str] | None = None, backend=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="GQA 4, contexts 512/4k/32k, batches 1 and 64, and the target row (scripts/gpu_check.sh)")
    parser.add_argument("--e2e", action="store_true", help="also greedy tokens/s of the in-process driver")
    parser.add_argument("--max-kv-gib", type=float, default=16.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: small shapes through the backend given (a run of the benchmark, not a figure)")
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (or --device cpu)")
    start_cpu = {"all": psutil.cpu_times(), "mine": sum(psutil.Process().cpu_times()[:2])}
    started = time.perf_counter()
    if backend is None:
        backend = cuda_backend() if device == "cuda" else TorchAttentionBackend()
    figures: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({type(backend).__name__})",
                     "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    print(f"device: {figures['device']}, torch {torch.__version__}", flush=True)

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))

    copy_bps = copy_bandwidth(2 << 30 if device == "cuda" else 16 << 20, device)
    figures["copy_GBps"] = copy_bps / 1e9
    print(f"device copy bandwidth: {figures['copy_GBps']:.0f} GB/s (read + write)", flush=True)
    if device == "cpu":
        shapes = ([64], [4], [64], [2])
    elif args.quick:  # B=64 at three contexts: the decode target's rows
        shapes = ([64, 128], [4], [512, 4096, 32768], [1, 64])
    else:
        shapes = ([64, 128], [1, 4, 8], [128, 512, 1024, 4096, 16384, 32768], [1, 16, 64, 256])
    print(f"decode (bf16, {NUM_KV_HEADS} KV heads, block {BLOCK_SIZE}):", flush=True)
    figures["decode"] = []
    bench_decode(backend, *shapes, args.max_kv_gib, copy_bps, figures["decode"], save, device)
    print("prefill chunks (bf16, 32 heads / 8 KV heads, head 128):", flush=True)
    figures["prefill"] = []
    bench_prefill(backend, copy_bps, figures["prefill"], save, device)
    if args.e2e and device == "cuda":
        print("end to end (random Llama-shaped model, bf16):", flush=True)
        figures["e2e"] = bench_e2e(64, 256, 64 if args.quick else 128)
    seconds = time.perf_counter() - started
    figures["others_cpu_share"] = others_cpu_share(start_cpu, seconds)
    print(f"took {seconds:.0f} s; other processes used {100 * figures['others_cpu_share']:.0f}% of the CPUs",
          flush=True)
    save()


def cuda_backend():
    from folio.core.executor.kernels.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend(DTYPE)


if __name__ == "__main__":
    main()

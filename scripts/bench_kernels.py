"""Kernel and end-to-end figures for the cuda backend on a GPU (run by scripts/gpu_check.sh).

1. Device copy bandwidth (a large device-to-device copy: bytes read + written per second), the
   ceiling a memory-bound kernel can approach.
2. Decode attention: achieved bandwidth of the paged kernel (K/V bytes it must read per call /
   time), as a fraction of (1), and the time of contiguous torch SDPA on equal shapes, for
   context lengths 512..32k and batches 1..256 (shapes of Llama-3-8B: 32 heads, 8 KV heads,
   head 128, bf16, block 16), skipping shapes whose K/V exceed --max-kv-gib.
3. End to end: greedy tokens/s of the in-process driver with the cuda backend against the torch
   backend, on a random-weight Llama-shaped model.

Speed figures come from here, never from tests. Usage:
    python scripts/bench_kernels.py [--quick] [--json out.json] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.executor.attention import AttentionMetadata  # noqa: E402
from services.executor.cuda_backend import CudaAttentionBackend  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16


def time_cuda(fn, warmup: int = 2, iters: int = 10) -> float:
    """Mean seconds per call, timed with CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * num_bytes / seconds  # read + write


def decode_case(batch: int, context: int, backend: CudaAttentionBackend) -> dict:
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    order = torch.randperm(num_blocks).view(batch, blocks_per_seq)  # scattered, as in a real pool
    tables = order.tolist()
    slots = order[:, (context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, slots, BLOCK_SIZE, "cuda")
    query = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    scale = HEAD_DIM**-0.5
    paged_s = time_cuda(lambda: backend.attend(query, k_cache, v_cache, meta, scale))
    plan = next(iter(meta.plan.values()))
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    # contiguous SDPA on the same shapes: [batch, heads, len, dim]
    q = query.unsqueeze(2)
    k = torch.randn((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    del k_cache, v_cache
    sdpa_s = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    return {"batch": batch, "context": context, "partitions": plan.num_partitions, "paged_ms": paged_s * 1e3,
            "paged_GBps": kv_bytes / paged_s / 1e9, "sdpa_ms": sdpa_s * 1e3, "sdpa_GBps": kv_bytes / sdpa_s / 1e9}


def bench_decode(contexts, batches, max_kv_gib: float) -> list[dict]:
    backend = CudaAttentionBackend(DTYPE)
    rows = []
    for context in contexts:
        for batch in batches:
            kv_gib = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2 / 2**30
            if kv_gib > max_kv_gib:
                continue
            rows.append(decode_case(batch, context, backend))
            torch.cuda.empty_cache()
            r = rows[-1]
            print(f"  B={batch:4d} L={context:6d} parts={r['partitions']:3d}  paged {r['paged_ms']:8.3f} ms "
                  f"{r['paged_GBps']:7.0f} GB/s   sdpa {r['sdpa_ms']:8.3f} ms {r['sdpa_GBps']:7.0f} GB/s", flush=True)
    return rows


def bench_e2e(num_prompts: int, prompt_len: int, max_tokens: int) -> dict:
    from services.executor.offline import generate
    from services.executor.runner import ModelRunner
    from shared.config import RuntimeConfig
    from shared.messages import SamplingParams
    from tests.conftest import write_tiny_model

    folder = tempfile.mkdtemp(prefix="folio-bench-model-")
    # Llama-shaped, ~100M parameters: attention is a visible share of the step time
    write_tiny_model(folder, vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (prompt_len,), generator=gen).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)  # no eos id given: runs to max_tokens
    result = {}
    for backend in ("torch", "cuda"):
        blocks = num_prompts * math.ceil((prompt_len + max_tokens) / 16) + 8
        config = RuntimeConfig(device="cuda", dtype="bfloat16", num_kv_blocks=blocks, block_size=16,
                               attention_backend=backend)
        runner = ModelRunner(config, folder)
        generate(runner, prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm up, compile
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = generate(runner, prompts, params, chunk_size=512)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        result[backend] = {"tokens_per_s": sum(map(len, outputs)) / seconds, "seconds": seconds}
        print(f"  {backend:5s}: {result[backend]['tokens_per_s']:9.1f} generated tokens/s ({seconds:.1f} s)", flush=True)
        del runner
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--max-kv-gib", type=float, default=16.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    figures: dict = {"device": torch.cuda.get_device_name()}
    figures["copy_GBps"] = copy_bandwidth() / 1e9
    print(f"device copy bandwidth: {figures['copy_GBps']:.0f} GB/s (read + write)", flush=True)
    contexts = [512, 4096, 32768] if args.quick else [512, 2048, 8192, 32768]
    batches = [1, 64] if args.quick else [1, 16, 64, 256]
    print("decode attention (bf16, 32 heads / 8 KV heads, head 128, block 16):", flush=True)
    figures["decode"] = bench_decode(contexts, batches, args.max_kv_gib)
    best = max(r["paged_GBps"] for r in figures["decode"])
    print(f"best decode bandwidth: {best:.0f} GB/s = {100 * best / figures['copy_GBps']:.0f}% of copy", flush=True)
    if not args.skip_e2e:
        print("end to end (random Llama-shaped model, bf16):", flush=True)
        figures["e2e"] = bench_e2e(64, 256, 64 if args.quick else 128)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

"""Random paged steps for the kernel tests (emulated and on a GPU): a pool with shuffled block
tables, partly filled last blocks, the step's metadata, and the reference results."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend


@dataclass
class Step:
    meta: AttentionMetadata
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], context filled in
    v_cache: torch.Tensor
    tables: list[list[int]]
    slots: torch.Tensor  # [num_tokens] int64


def make_step(query_lens, seq_lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
              device="cpu", seed=0, spare_blocks=3) -> Step:
    """Blocks are handed out in a shuffled order (with spare, never-used blocks in between), and
    every context slot, old and new, already holds K/V: attend tests need no write first."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start : start + n])
        start += n
    slots = []
    for table, q_len, s_len in zip(tables, query_lens, seq_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len)]
    slots_t = torch.tensor(slots, dtype=torch.int64)
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, slots_t, block_size, device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    query = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype).to(device)
    return Step(meta, query, k_cache, v_cache, tables, slots_t.to(device))


def make_fp8_step(query_lens, seq_lens, dtype, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                  device="cpu", seed=0) -> Step:
    """A step over an fp8 (e4m3) pool holding random K/V quantized with FP8_KV_SCALES; the query in ``dtype``."""
    from folio.core.executor.kernels.kv_quant import quantize

    step = make_step(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=block_size, seed=seed)
    step.query = step.query.to(dtype).to(device)
    step.k_cache = quantize(step.k_cache * 3.0, FP8_KV_SCALES[0]).to(device)
    step.v_cache = quantize(step.v_cache, FP8_KV_SCALES[1]).to(device)
    step.meta = replace(step.meta, **{f: getattr(step.meta, f).to(device) for f in
                                      ("slot_mapping", "positions", "query_start_loc", "seq_lens", "block_tables")})
    step.slots = step.slots.to(device)
    return step


FP8_KV_SCALES = (0.02, 0.011)


def fresh_meta(step: Step) -> AttentionMetadata:
    """The same step's metadata with no backend plan attached."""
    return replace(step.meta, plan=None)


def reference_attention(step: Step, scale: float) -> torch.Tensor:
    """The torch backend on fp32 copies (the kernels accumulate in fp32 and round once)."""
    return TorchAttentionBackend().attend(step.query.float(), step.k_cache.float(), step.v_cache.float(),
                                          fresh_meta(step), scale)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

"""Paged attention (torch backend) against dense causal attention, through random block tables."""

from __future__ import annotations

import random

import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend, dense_causal_attention


def make_step(seq_specs, num_kv_heads, num_heads, head_dim, block_size, num_blocks, seed, dtype=torch.float32):
    """Random contexts already in a shuffled pool, plus this step's new tokens.

    ``seq_specs``: (num_cached_tokens, num_new_tokens) per sequence. Returns everything the test
    needs: the pool, the metadata, the new q/k/v, and each sequence's full dense K/V.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, shuffled block ids
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables, dense, q_parts, k_new, v_new, slots = [], [], [], [], [], []
    for cached, new in seq_specs:
        total = cached + new
        table = [free.pop() for _ in range((total + block_size - 1) // block_size)]
        tables.append(table)
        k_full = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_full = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(cached):  # the cached context is already in the pool
            blk, off = table[p // block_size], p % block_size
            k_cache[blk, off], v_cache[blk, off] = k_full[p], v_full[p]
        for p in range(cached, total):
            slots.append(table[p // block_size] * block_size + p % block_size)
        k_new.append(k_full[cached:])
        v_new.append(v_full[cached:])
        q_parts.append(torch.randn(new, num_heads, head_dim, generator=gen).to(dtype))
        dense.append((k_full, v_full))
    meta = AttentionMetadata.build(
        [n for _, n in seq_specs],
        [c + n for c, n in seq_specs],
        tables,
        torch.tensor(slots, dtype=torch.long),
        block_size,
    )
    return k_cache, v_cache, meta, torch.cat(q_parts), torch.cat(k_new), torch.cat(v_new), dense


SPECS = [
    [(0, 1)],  # first token alone
    [(37, 1), (5, 1), (16, 1), (100, 1)],  # decode only, partly filled last blocks
    [(0, 23)],  # whole prompt
    [(19, 9), (0, 40)],  # chunks after a cached prefix
    [(64, 1), (0, 17), (33, 7), (3, 1), (15, 2)],  # mixed decode, prefill and verification chunks
]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("spec_idx", range(len(SPECS)))
def test_paged_attention_equals_dense(num_heads, num_kv_heads, block_size, spec_idx):
    specs = SPECS[spec_idx]
    head_dim = 16
    k_cache, v_cache, meta, q, k, v, dense = make_step(
        specs, num_kv_heads, num_heads, head_dim, block_size, num_blocks=64, seed=spec_idx
    )
    backend = TorchAttentionBackend()
    backend.write_kv(k, v, k_cache, v_cache, meta)
    scale = head_dim**-0.5
    out = backend.attend(q, k_cache, v_cache, meta, scale)
    start = 0
    for (cached, new), (k_full, v_full) in zip(specs, dense):
        expected = dense_causal_attention(q[start : start + new], k_full, v_full, scale)
        torch.testing.assert_close(out[start : start + new], expected, rtol=1e-5, atol=1e-5)
        start += new


def test_cache_write_lands_in_the_right_slots_and_skips_padding():
    k_cache, v_cache, meta, q, k, v, dense = make_step([(3, 5), (0, 2)], 2, 2, 8, 4, 16, seed=7)
    before_k = k_cache.clone()
    meta.slot_mapping[2] = -1  # a padding token: must not be written anywhere
    TorchAttentionBackend().write_kv(k, v, k_cache, v_cache, meta)
    flat_k = k_cache.view(-1, 2, 8)
    slots = meta.slot_mapping.tolist()
    for i, slot in enumerate(slots):
        if slot >= 0:
            torch.testing.assert_close(flat_k[slot], k[i])
    changed = (k_cache != before_k).flatten(1).any(dim=1).nonzero().flatten().tolist()
    expected_blocks = sorted({s // 4 for s in slots if s >= 0})
    assert changed == expected_blocks


def test_copy_blocks_copies_every_layer():
    caches = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(3)]
    originals = [(k.clone(), v.clone()) for k, v in caches]
    TorchAttentionBackend().copy_blocks(caches, [(1, 4), (3, 0)])
    for (k, v), (k0, v0) in zip(caches, originals):
        torch.testing.assert_close(k[4], k0[1])
        torch.testing.assert_close(v[0], v0[3])
        torch.testing.assert_close(k[2], k0[2])  # untouched


def test_bf16_pool_close_to_fp32_oracle():
    k_cache, v_cache, meta, q, k, v, dense = make_step([(20, 1), (0, 9)], 2, 4, 16, 8, 16, 3, torch.bfloat16)
    backend = TorchAttentionBackend()
    backend.write_kv(k, v, k_cache, v_cache, meta)
    out = backend.attend(q, k_cache, v_cache, meta, 0.25)
    expected = torch.cat([dense_causal_attention(q[:1], *dense[0], 0.25), dense_causal_attention(q[1:], *dense[1], 0.25)])
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)

"""Paged attention over the KV block pool: the step metadata and the ``torch`` backend.

The model calls a backend twice per layer: ``write_kv`` puts the step's new K/V into their slots
of the pool, ``attend`` computes attention for every new token against its sequence's context,
read through the sequence's block table. The torch backend here is the reference (and the CPU
default): plain torch ops, the oracle the CUDA kernels are tested against.

Pool layout (per layer, K and V alike): ``[num_blocks, block_size, num_kv_heads, head_dim]``; an
fp8 pool (``kv_quant``) stores e4m3 values with the layer's scales, the gather dequantizes.
Slot of the token at position p: ``block_table[p // block_size] * block_size + p % block_size``.

More in docs/modules.md (folio/core/executor/kernels/attention.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from folio.core.executor.kernels.kv_quant import FP8_DTYPE, dequantize, quantize, raw, split_scales, stored
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS

SHORT_CHUNK_ROWS = 16  # chunks this short (verification: k + 1 tokens) attend row by row, as decodes


@dataclass
class AttentionMetadata:
    """One step's varlen batch, built once and shared by every layer.

    Sequences are laid out one after another in the flattened token dimension: sequence b owns
    tokens ``query_start_loc[b]:query_start_loc[b+1]``, which sit at positions
    ``seq_lens[b] - query_len .. seq_lens[b] - 1`` (the cached context comes before them).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; negative = padding, not written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with block 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies, so that backends can plan without device syncs
    query_lens_list: list[int] = field(default_factory=list)
    seq_lens_list: list[int] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [num_tokens] int64, each new token's position
    # whether some slots are padding (negative): None = unknown, look at the device
    padded: bool | None = None
    # tree drafts: sequence b -> [query_len] uint64, bit j of row i set when row i sees the chunk's
    # token j (the root, token 0, and the nodes on row i's path); the rows see their context, the
    # ``seq_len - query_len`` keys before the chunk, and those alone. None: every chunk is causal
    trees: dict[int, np.ndarray] | None = None
    # images whose placeholders attend each other both ways (Gemma 3): sequence b -> the [start, end)
    # positions of each image its chunk reaches, whole (a step never splits one). A token inside
    # one also sees the image's later keys; a sliding-window layer's window stays the token's own.
    # None: every chunk is causal
    image_spans: dict[int, list[tuple[int, int]]] | None = None
    # backend-private plan (built lazily by the backend, once per step)
    plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: torch.Tensor | None,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Tensors built on the host, then moved once. ``slot_mapping=None`` derives each new
        token's slot from its sequence's block table (the usual case)."""
        padded = None if slot_mapping is not None else False
        num_seqs = len(query_lens)
        max_blocks = max((len(t) for t in block_tables), default=1) or 1
        table = torch.zeros((num_seqs, max_blocks), dtype=torch.int32)
        for b, blocks in enumerate(block_tables):
            if blocks:
                table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        # the new tokens of a sequence are its last query_len positions
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]) if num_seqs \
            else torch.zeros(0, dtype=torch.long)
        if slot_mapping is None:
            seq_idx = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(query_lens, dtype=torch.long))
            slot_mapping = table[seq_idx, positions // block_size].long() * block_size + positions % block_size
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            positions=positions.to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            padded=padded,
        )


@dataclass
class _DecodeGroup:
    """Tokens attended one query row each, as one padded batch: decode tokens, and the tokens of
    short chunks (each with the keys up to its own position)."""

    token_idx: torch.Tensor  # [num_decode] rows of q that belong to this group
    block_tables: torch.Tensor  # [num_decode, max_blocks]
    key_mask: torch.Tensor  # [num_decode, 1, 1, max_blocks * block_size] True = attend
    lens: list[int] = field(default_factory=list)  # keys each row sees (its position + 1, or its image's end)
    window_ends: list[int] | None = None  # where a row's window ends (its position + 1), when not at its lens
    # window -> (block tables [num_decode, blocks], key mask [num_decode, 1, 1, blocks * block_size])
    windows: dict = field(default_factory=dict)
    tree: bool = False  # some rows are a tree draft's (no sliding window then)

    def windowed(self, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks and key mask of a sliding-window layer: each row's table from the block that
        holds its window's first key (earlier blocks are not read), its keys masked to the window."""
        if self.tree:
            raise ValueError("tree drafts are not verified in sliding-window layers")
        if window not in self.windows:
            device = self.block_tables.device
            ends = self.window_ends or self.lens
            first = [max(0, e - window) // block_size for e in ends]  # each row's first block
            width = max((n + block_size - 1) // block_size - f for n, f in zip(self.lens, first))
            lens, ends = torch.tensor(self.lens, device=device), torch.tensor(ends, device=device)
            idx = torch.tensor(first, device=device)[:, None] + torch.arange(width, device=device)  # [rows, width]
            # entries past a row's table are masked below: the clamp only keeps the gather in range
            tables = self.block_tables.gather(1, idx.clamp(max=self.block_tables.shape[1] - 1))
            key_pos = (idx[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
            mask = (key_pos < lens[:, None]) & (key_pos >= ends[:, None] - window)
            self.windows[window] = (tables, mask[:, None, None, :])
        return self.windows[window]


@dataclass
class _ChunkSeq:
    """A sequence with more than ``SHORT_CHUNK_ROWS`` new tokens (a prefill chunk): attended alone."""

    start: int
    end: int
    block_ids: torch.Tensor  # [num_blocks_needed]
    seq_len: int
    mask: torch.Tensor  # [1, 1, query_len, seq_len] causal against the cached context (and its images' squares)
    spans: tuple[tuple[int, int], ...] = ()  # ``AttentionMetadata.image_spans``' of this sequence
    # window -> (first key position gathered, block ids from there, mask [1, 1, query_len, keys])
    windows: dict = field(default_factory=dict)

    def windowed(self, window: int, block_size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A sliding-window layer's view: the blocks from the one holding the chunk's first
        query's first key, and the causal mask within the window over their keys."""
        if window not in self.windows:
            query_len = self.end - self.start
            first_block = max(0, self.seq_len - query_len - window + 1) // block_size
            key_start = first_block * block_size
            device = self.block_ids.device
            k_pos = torch.arange(key_start, self.seq_len, device=device)
            q_pos = torch.arange(self.seq_len - query_len, self.seq_len, device=device)[:, None]
            mask = ((k_pos[None, :] <= q_pos) | _same_image(q_pos[:, 0], k_pos, self.spans)) \
                & (k_pos[None, :] > q_pos - window)
            self.windows[window] = (key_start, self.block_ids[first_block:], mask[None, None])
        return self.windows[window]


@dataclass
class _TorchPlan:
    decode: _DecodeGroup | None
    chunks: list[_ChunkSeq]
    write_idx: torch.Tensor | None  # rows to write when some slots are padding, else None


def _same_image(q_pos: torch.Tensor, k_pos: torch.Tensor, spans) -> torch.Tensor | bool:
    """[queries, keys]: whether query and key are placeholders of one image (``spans``: [start, end) runs)."""
    same = False
    for s, e in spans:
        same = same | (((q_pos >= s) & (q_pos < e))[:, None] & ((k_pos >= s) & (k_pos < e))[None, :])
    return same


def _image_end(pos: int, spans) -> int:
    """One past the last key the token at ``pos`` sees: its own, or its image's last placeholder."""
    return max([pos + 1] + [e for s, e in spans if s <= pos < e])


def decode_rows_and_chunks(meta: AttentionMetadata, max_row_chunk: int = SHORT_CHUNK_ROWS
                           ) -> tuple[list[tuple[int, int, int, int, int]], list[_ChunkSeq]]:
    """(row of q, sequence, keys this token sees, extra keys, window end) for each token
    attended as a decode, and the chunks attended whole. A row sees its sequence's first keys, then
    the positions after them whose bits are set in its extra keys (a tree draft's rows,
    ``meta.trees``: the context before the chunk, then the row's own path; 0 for every other row).
    Its sliding window ends at its window end: its own position + 1, less than its keys for a token
    inside an image that attends both ways (``meta.image_spans``: it sees the image whole). Decode
    tokens, and each token of a short chunk (speculative verification) as if it were decoded alone, so that a verified token is computed exactly as
    plain decoding computes it. SDPA with several query rows runs another kernel, whose last bits
    differ; with bf16 activations (the quantized layers) such a bit can flip a near-tie and change
    a greedy output. ``max_row_chunk``: chunks up to this long go row by row (a batch-invariant
    backend passes no limit: every token is attended as a decode, prefill included)."""
    device, bs = meta.block_tables.device, meta.block_size
    starts = meta.query_start_loc.tolist()
    trees, images = meta.trees or {}, meta.image_spans or {}
    rows: list[tuple[int, int, int, int, int]] = []
    chunks = []
    for b, n in enumerate(meta.query_lens_list):
        seq_len, spans = meta.seq_lens_list[b], tuple(images.get(b, ()))
        if any(e > seq_len for _, e in spans):  # its later keys are not written yet
            raise ValueError(f"sequence {b}: a step that ends inside an image ({spans} for {seq_len} keys)")
        if b in trees:
            if not 0 < n <= 64 or len(trees[b]) != n:
                raise ValueError(f"sequence {b}: a tree of {len(trees[b])} rows for a chunk of {n} (at most 64)")
            rows += [(starts[b] + i, b, seq_len - n, int(m), seq_len - n) for i, m in enumerate(trees[b])]
        elif 0 < n <= max_row_chunk:
            rows += [(starts[b] + i, b, _image_end(p, spans), 0, p + 1)
                     for i, p in enumerate(range(seq_len - n, seq_len))]
        elif n > max_row_chunk:
            k_pos = torch.arange(seq_len, device=device)
            q_pos = k_pos[seq_len - n:]
            mask = (k_pos[None, :] <= q_pos[:, None]) | _same_image(q_pos, k_pos, spans)
            chunks.append(_ChunkSeq(start=starts[b], end=starts[b] + n,
                                    block_ids=meta.block_tables[b, :(seq_len + bs - 1) // bs].long(),
                                    seq_len=seq_len, mask=mask[None, None], spans=spans))
    return rows, chunks


def _row_end(row: tuple[int, int, int, int, int]) -> int:
    """One past the last key position a decode row reads."""
    return row[2] + row[3].bit_length()


def attention_options(window, softcap) -> tuple[int, float]:
    """``attend``'s window and soft-cap, checked once for every backend: a window >= 0, a soft-cap 0
    or a positive fp32 (the kernels compute in fp32)."""
    window, softcap = int(window), float(softcap)
    if window < 0 or not (softcap == 0.0 or 0.0 < np.float32(softcap) < math.inf):
        raise ValueError(f"window must be >= 0 and softcap 0 or a positive fp32, got {window} and {softcap}")
    return window, softcap


class TorchAttentionBackend:
    """Reference paged attention in plain torch ops.

    Attention for a sequence gathers its blocks through the block table into a transient
    workspace (what a kernel does in registers and shared memory) and runs SDPA with a mask that
    is causal against the cached context. Nothing outlives the call: the pool is the only KV
    storage. Decode tokens and the tokens of short chunks (verification) go as one padded batch,
    one query row each; longer chunks go one sequence at a time, since each is already a
    matrix-sized piece of work. A sliding-window layer gathers each row's (each chunk's) blocks
    from the first one its window reaches and masks the rest of the window's edge; a soft-capped
    layer computes its scores explicitly (``_attention``).
    """

    name = "torch"
    layer_ops = TORCH_LAYER_OPS  # the model's norms, RoPE and activation: plain torch
    verifies_trees = True  # its decode rows take a tree draft's masks (``AttentionMetadata.trees``)
    attends_image_spans = True  # and ``AttentionMetadata.image_spans`` (its rows and its chunks' masks)

    def plan(self, meta: AttentionMetadata) -> _TorchPlan:
        if isinstance(meta.plan, _TorchPlan):
            return meta.plan
        device = meta.block_tables.device
        bs = meta.block_size
        rows, chunks = decode_rows_and_chunks(meta)
        decode = None
        if rows:
            # torch's CPU SDPA splits a batch of one sequence differently over threads than a
            # larger batch (other last bits): one row attends as a batch of two
            rows = rows * 2 if len(rows) == 1 else rows
            token_idx, seqs, lens = (torch.tensor(col, dtype=torch.long, device=device) for col in list(zip(*rows))[:3])
            max_blocks = (max(_row_end(r) for r in rows) + bs - 1) // bs
            key_pos = torch.arange(max_blocks * bs, device=device)
            key_mask = key_pos[None, :] < lens[:, None]
            if any(r[3] for r in rows):  # tree rows: their ancestors' keys after the context
                extra = torch.tensor([[(r[3] >> j) & 1 for j in range(64)] for r in rows], dtype=torch.bool)
                after = key_pos[None, :] - lens[:, None]
                key_mask |= extra.to(device).gather(1, after.clamp(0, 63)) & (after >= 0) & (after < 64)
            decode = _DecodeGroup(token_idx=token_idx, block_tables=meta.block_tables[seqs, :max_blocks].long(),
                                  key_mask=key_mask[:, None, None, :], lens=[r[2] for r in rows],
                                  window_ends=[r[4] for r in rows] if any(r[4] != r[2] for r in rows) else None,
                                  tree=any(r[3] for r in rows))
        meta.plan = _TorchPlan(decode=decode, chunks=chunks, write_idx=_write_idx(meta))
        return meta.plan

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales=(1.0, 1.0),  # an fp8 pool's (k_scale, v_scale) or KVScales: stored = (value - shift) / scale
    ) -> None:
        # only the padding rows matter here: the attention plan waits for ``attend``
        write_idx = meta.plan.write_idx if isinstance(meta.plan, _TorchPlan) else _write_idx(meta)
        slots = meta.slot_mapping
        if write_idx is not None:
            slots = slots[write_idx]
            key = key[write_idx]
            value = value[write_idx]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        if k_cache.dtype == FP8_DTYPE:
            k_scale, v_scale, k_shift = split_scales(kv_scales)
            key, value = quantize(key, k_scale, k_shift), quantize(value, v_scale)
        raw(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, raw(key.to(k_cache.dtype)))
        raw(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, raw(value.to(v_cache.dtype)))

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales=(1.0, 1.0),  # an fp8 pool's (k_scale, v_scale) or KVScales: dequantized = stored * scale
        window: int = 0,  # > 0: position p attends keys p - window < k <= p (a sliding-window layer)
        softcap: float = 0.0,  # > 0: score = softcap * tanh(score / softcap), after the scale
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        window, softcap = attention_options(window, softcap)
        plan = self.plan(meta)
        out = torch.empty_like(query)
        self._attend_decode(out, query, k_cache, v_cache, plan, scale, kv_scales, window, softcap)
        self._attend_chunks(out, query, k_cache, v_cache, plan.chunks, scale, kv_scales, window, softcap)
        return out

    def _attend_decode(self, out, query, k_cache, v_cache, plan, scale, kv_scales, window=0, softcap=0.0) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        if plan.decode is not None:
            group = plan.decode
            tables, key_mask = (group.block_tables, group.key_mask) if window == 0 else \
                group.windowed(window, k_cache.shape[1])
            num_decode = tables.shape[0]
            # k, v: [num_decode, num_kv_heads, blocks * block_size, head_dim]
            # index_select, not advanced indexing: the same gather, several times faster on the CPU
            k = stored(gather_blocks(k_cache, tables), k_cache.dtype).view(num_decode, -1, num_kv_heads, head_dim)
            v = stored(gather_blocks(v_cache, tables), v_cache.dtype).view(num_decode, -1, num_kv_heads, head_dim)
            q = query[group.token_idx].unsqueeze(2)  # [num_decode, num_heads, 1, head_dim]
            o = _attention(q, k.transpose(1, 2), v.transpose(1, 2), key_mask, scale, kv_scales, softcap)
            out[group.token_idx] = o.squeeze(2)

    def _attend_chunks(self, out, query, k_cache, v_cache, chunks: list[_ChunkSeq], scale, kv_scales, window=0,
                       softcap=0.0) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        for chunk in chunks:
            key_start, block_ids, mask = (0, chunk.block_ids, chunk.mask) if window == 0 else \
                chunk.windowed(window, k_cache.shape[1])
            num_keys = chunk.seq_len - key_start
            k = stored(gather_blocks(k_cache, block_ids), k_cache.dtype).view(-1, num_kv_heads, head_dim)[:num_keys]
            v = stored(gather_blocks(v_cache, block_ids), v_cache.dtype).view(-1, num_kv_heads, head_dim)[:num_keys]
            q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            o = _attention(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), mask, scale, kv_scales,
                           softcap)
            out[chunk.start : chunk.end] = o.squeeze(0).transpose(0, 1)

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer."""
        if not pairs:
            return
        device = kv_caches[0][0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        for k_cache, v_cache in map(lambda kv: map(raw, kv), kv_caches):  # raw bytes (fp8 pools too)
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def swap_out(self, kv_caches, host_caches, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: device pool -> host pool, every layer."""
        _copy_between(kv_caches, host_caches, pairs)

    def swap_in(self, host_caches, kv_caches, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: host pool -> device pool, every layer."""
        _copy_between(host_caches, kv_caches, pairs)


def _attention(
    q: torch.Tensor,  # [batch, num_heads, query_len, head_dim]
    k: torch.Tensor,  # [batch, num_kv_heads, keys, head_dim] as stored in the pool
    v: torch.Tensor,
    mask: torch.Tensor,  # [batch or 1, 1, query_len or 1, keys] True = attend
    scale: float,
    kv_scales,  # (k_scale, v_scale) or KVScales; a scale is a float or [num_kv_heads, head_dim]
    softcap: float,
) -> torch.Tensor:  # [batch, num_heads, query_len, head_dim]
    """SDPA without a cap; with one, the scores explicitly in fp32: scale, cap, mask, softmax, @ v.

    The mask is a select (``masked_fill``), not an added -inf, so a masked score's value never
    reaches the softmax. What the gathered blocks hold at masked positions still meets a zero
    weight in p @ v, so it must be finite: it is the sequence's own keys before its window inside
    the window's first block, or slots past its end (written or zeroed pool entries, as without a
    window). Blocks wholly before the window, the ones a scheduler may free, are not gathered."""
    # per head and channel scales against [batch, kv_heads, keys, head_dim]
    k_scale, v_scale = (s.unsqueeze(-2) if isinstance(s, torch.Tensor) else s for s in split_scales(kv_scales)[:2])
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if softcap == 0.0:
        return F.scaled_dot_product_attention(q, dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype),
                                              attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
    batch, _, query_len, head_dim = q.shape
    group = num_heads // num_kv_heads  # query head h reads KV head h // group
    qg = q.float().reshape(batch, num_kv_heads, group * query_len, head_dim)
    s = (qg @ dequantize(k, k_scale, torch.float32).transpose(-1, -2)) * scale  # [batch, kv_heads, g * L, keys]
    s = torch.tanh(s / softcap) * softcap
    s = s.view(batch, num_heads, query_len, -1).masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).view(batch, num_kv_heads, group * query_len, -1)
    o = p @ dequantize(v, v_scale, torch.float32)  # [batch, kv_heads, g * L, head_dim]
    return o.view(batch, num_heads, query_len, head_dim).to(q.dtype)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The pool's blocks ``block_ids`` (any shape of ids) as raw bytes, ``[*ids.shape, block_size, ...]``.
    ``index_select`` rather than ``cache[ids]``: the same copy, but torch's CPU advanced indexing
    took about 3 ms to gather a 512-token sequence from a 5,825-block pool where this takes 0.07 ms
    (it was 13-19% of an embedding run's time)."""
    src = raw(cache)
    return src.index_select(0, block_ids.reshape(-1)).view(*block_ids.shape, *src.shape[1:])


def _write_idx(meta: AttentionMetadata) -> torch.Tensor | None:
    """Rows whose slot is real, when some are padding; None when all are real."""
    if meta.padded is False or not bool((meta.slot_mapping < 0).any()):
        return None
    return torch.nonzero(meta.slot_mapping >= 0).flatten()


def move_slots(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: list[int], dst: list[int]) -> None:
    """Slot ``dst[i]`` of every layer's K and V becomes a copy of slot ``src[i]`` (a verified tree
    draft's path, moved to its positions' slots). The sources are read before any is written."""
    if not src:
        return
    device = kv_caches[0][0].device
    src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst))
    for cache in (c for kv in kv_caches for c in kv):
        rows = raw(cache).view(-1, *cache.shape[2:])  # [slots, kv_heads, head_dim], raw bytes (fp8 pools too)
        rows.index_copy_(0, dst_t, rows.index_select(0, src_t))


def _copy_between(src_caches, dst_caches, pairs: list[tuple[int, int]]) -> None:
    """Block src of ``src_caches`` -> block dst of ``dst_caches``, per layer, K and V (one gather
    on the source's device, one scatter on the destination's)."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src_caches[0][0].device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst_caches[0][0].device)
    # asynchronous only towards a GPU: a device-to-host copy must be complete before the host
    # scatter reads it
    non_blocking = dst_caches[0][0].device.type == "cuda"
    for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches):
        src_k, src_v, dst_k, dst_v = map(raw, (src_k, src_v, dst_k, dst_v))  # raw bytes (fp8 pools too)
        dst_k.index_copy_(0, dst, src_k.index_select(0, src).to(dst_k.device, non_blocking=non_blocking))
        dst_v.index_copy_(0, dst, src_v.index_select(0, src).to(dst_v.device, non_blocking=non_blocking))


def dense_causal_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Textbook attention for one sequence whose queries are its last ``query_len`` tokens
    (``window`` and ``softcap`` as ``attend`` takes them).

    Written with explicit matmuls and softmax (no SDPA), so that tests have an oracle that shares
    no code with the backends.
    """
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.repeat_interleave(group, dim=1).float()
    v = value.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window > 0 else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)

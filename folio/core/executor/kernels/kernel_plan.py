"""Step planning of the ``cuda`` attention backend: which kernel takes which sequence, the work
items along the grid, and into how many splits each kernel cuts the context.

More in docs/modules.md (folio/core/executor/kernels/kernel_plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.attention import AttentionMetadata

MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535  # CUDA's grid limits

# Chunk kernel: split when the context spans several partitions and either the grid has fewer
# than 2 CTAs per SM or the context is very long (vLLM's v1/v2 threshold is 8192 too).
SPLIT_ABOVE_SEQ_LEN = 8192
MIN_BLOCKS_PER_SM = 2

# Decode kernel: FlashAttention's split rule (no split once the grid holds 0.8 x the CTA slots;
# else the fewest splits within 85% of the best wave efficiency). A decode CTA is small (128
# threads, 24-36 KB of shared memory), so several run on an SM at once: the slots are SMs x 4, an
# estimate not yet measured. Splits are whole granules of keys.
DECODE_CTAS_PER_SM = 4
DECODE_SPLIT_GRANULE = 64
MAX_DECODE_SPLITS = 128


@dataclass
class PathPlan:
    """One kernel's share of a step."""

    items: torch.Tensor  # decode: [n] int32 sequences; chunk: [n, 2] int32 (sequence, first row)
    num_items: int
    tokens: torch.Tensor  # [num_path_tokens] int32: the tokens this path computes (the reduce's list)
    num_tokens: int
    num_splits: int  # 1: unsplit, the kernel writes the output itself
    split_size: int  # keys per split
    partials: tuple[torch.Tensor, torch.Tensor] | None = None  # (part_out, part_lse), shared by layers
    arg_cache: dict = field(default_factory=dict)  # the backend's launch arguments per layer


@dataclass
class KernelPlan:
    group: int
    decode: PathPlan | None
    chunk: PathPlan | None


def work_items(query_lens: list[int], group: int, rows_per_block: int = ck.ATTN_ROWS) -> list[tuple[int, int]]:
    """(sequence, first row) of every chunk-kernel CTA; a sequence has q_len * group rows (a
    sequence of length 0 here has none)."""
    items = []
    for seq, q_len in enumerate(query_lens):
        items.extend((seq, row0) for row0 in range(0, q_len * group, rows_per_block))
    return items


def num_splits_heuristic(num_ctas: int, num_slots: int, num_granules: int, max_splits: int) -> int:
    """FlashAttention's rule: 1 when the grid nearly fills the GPU; else the fewest splits whose
    wave efficiency (CTAs / slots, over its ceiling) is within 85% of the best. A split count that
    leaves the granules per split unchanged from one fewer split is not eligible."""
    if num_ctas >= 0.8 * num_slots:
        return 1
    max_splits = min(max_splits, num_slots, num_granules)
    if max_splits <= 1:
        return 1

    def eligible(s: int) -> bool:
        return s == 1 or math.ceil(num_granules / s) != math.ceil(num_granules / (s - 1))

    efficiency = {}
    for s in range(1, max_splits + 1):
        if eligible(s):
            waves = num_ctas * s / num_slots
            efficiency[s] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return next(s for s, e in efficiency.items() if e >= 0.85 * best)


def build_plan(meta: AttentionMetadata, group: int, num_kv_heads: int, num_sms: int, split: bool | None,
               partition_size: int, rows_per_item: int = ck.ATTN_ROWS, window: int = 0,
               like: KernelPlan | None = None, invariant: bool = False) -> KernelPlan:
    """``split``: None decides per step; True/False force it (tests, benchmarks). Forced splits
    are ``partition_size`` keys long. ``rows_per_item``: rows per chunk CTA (64 for the
    tensor-core prefill kernel, 8 for the CUDA-core one).

    ``window`` > 0 (a sliding-window layer): splits are sized by the keys a CTA actually reads,
    at most ``window`` for a decode sequence and ``window - 1`` plus the tokens of a work item for
    a chunk CTA; the chunk kernels cut split plans' partitions from the window's first key rounded
    down to a multiple of the partition size, the decode kernel from the window's first key. ``like``: the plan of
    the same step and GQA shape for another window, whose item and token tensors are reused (no
    new host-to-device copies, so a windowed plan may be built during a CUDA graph's capture).
    ``invariant``: a batch-invariant plan (see the module docstring; ``split`` is then ignored)."""
    q_lens, s_lens = meta.query_lens_list, meta.seq_lens_list
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    device = meta.block_tables.device
    is_decode = [n == 1 and group <= ck.DECODE_MAX_GROUP and not invariant for n in q_lens]

    decode = None
    seqs = [b for b, d in enumerate(is_decode) if d]
    if seqs:
        max_len = max(1, max(_window_keys(s_lens[b], window, 1) for b in seqs))  # keys per sequence
        if split is None:
            granules = math.ceil(max_len / DECODE_SPLIT_GRANULE)
            splits = num_splits_heuristic(len(seqs) * num_kv_heads, num_sms * DECODE_CTAS_PER_SM, granules,
                                          MAX_DECODE_SPLITS)
            size = math.ceil(granules / splits) * DECODE_SPLIT_GRANULE
        else:
            size = partition_size if split else max_len
        splits = math.ceil(max_len / size)
        if like is not None and like.decode is not None:
            items_t, tokens_t = like.decode.items, like.decode.tokens
        else:
            items_t, tokens_t = _int32(seqs, device), _int32([starts[b] for b in seqs], device)
        decode = PathPlan(items_t, len(seqs), tokens_t, len(seqs), splits, size)

    chunk = None
    chunk_lens = [0 if d else n for n, d in zip(q_lens, is_decode)]
    items = work_items(chunk_lens, group, rows_per_item)
    if items:
        # a CTA's rows span at most (rows - 1) // group + 2 tokens, each seeing `window` keys
        tokens_per_item = (rows_per_item - 1) // group + 2
        max_len = max(1, max(_window_keys(s, window, tokens_per_item) for s, n in zip(s_lens, chunk_lens) if n))
        if invariant:
            size = partition_size  # fixed: never sized by the context or the batch
        else:
            size = max(partition_size, math.ceil(max_len / MAX_GRID_YZ))  # partitions go along grid z
        # a window's partitions start at its first key rounded down to a multiple of the size
        parts = max(1, math.ceil((max_len + (size - 1 if window > 0 else 0)) / size))
        if invariant:
            if parts > MAX_GRID_YZ:
                raise ValueError(f"a context of {max_len} keys needs {parts} partitions of {size} keys, more than "
                                 f"CUDA's grid takes along z ({MAX_GRID_YZ}) in batch-invariant mode")
        elif split is None:
            fills_gpu = len(items) * num_kv_heads >= MIN_BLOCKS_PER_SM * num_sms
            parts = parts if parts > 1 and (not fills_gpu or max_len > SPLIT_ABOVE_SEQ_LEN) else 1
        elif not split:
            parts = 1
        if parts == 1 and not invariant:
            size = 0  # the kernels' one partition: the CTA's own key range
        num_tokens = sum(chunk_lens)
        if like is not None and like.chunk is not None:
            items_t, tokens_t = like.chunk.items, like.chunk.tokens
        else:
            tokens = [t for b, n in enumerate(chunk_lens) for t in range(starts[b], starts[b] + n)]
            items_t, tokens_t = _int32(items, device), _int32(tokens, device)
        chunk = PathPlan(items_t, len(items), tokens_t, num_tokens, parts, size)
    for path in (decode, chunk):
        if path is not None and path.num_items * path.num_splits > MAX_GRID_X:
            raise ValueError(f"{path.num_items * path.num_splits} attention CTAs exceed CUDA's grid")
    return KernelPlan(group, decode, chunk)


def _window_keys(seq_len: int, window: int, tokens: int) -> int:
    """The most keys a CTA of ``tokens`` consecutive query tokens reads from a context of ``seq_len``."""
    return seq_len if window <= 0 else min(seq_len, window - 1 + tokens)


def _int32(values: list, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)

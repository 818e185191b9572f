"""CUDA graphs of the decode step: one per padded batch size, captured at start, replayed per step.

More in docs/modules.md (folio/core/executor/runtime/cuda_graphs.py).
"""

from __future__ import annotations

import bisect

import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.kernels.cuda_kernels import DECODE_MAX_GROUP
from folio.core.executor.runtime.input_batch import StepInputs
from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor import startup

MAX_GRAPH_BATCH = 256


def graph_buckets(max_num_seqs: int, largest: int = MAX_GRAPH_BATCH) -> list[int]:
    """1, 2, 4, then multiples of 8, up to min(max_num_seqs, largest), which is always included."""
    cap = max(1, min(max_num_seqs, largest))
    sizes = [b for b in (1, 2, 4) if b <= cap] + list(range(8, cap + 1, 8))
    return sizes if sizes[-1] == cap else sizes + [cap]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` sequences (None: above the largest)."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def uses_graphs(config, spec, backend, device: torch.device) -> bool:
    """On a GPU with the kernel backend (the torch backend plans on the host from per-step lists),
    for GQA groups the decode kernel takes, unless ``enforce_eager``."""
    return (not config.enforce_eager and device.type == "cuda" and isinstance(backend, KernelAttentionBackend)
            and spec.num_heads // spec.num_kv_heads <= DECODE_MAX_GROUP)


def graph_memory_estimate(config, activation_bytes: int) -> int:
    """Bytes the graphs keep: their private pool holds the activations of the largest bucket
    (captured first; the smaller ones reuse its pool), estimated from the profiled forward's
    activations at ``max_num_batched_tokens`` tokens, scaled to the bucket's."""
    largest = graph_buckets(config.max_num_seqs)[-1]
    return int(activation_bytes * min(1.0, largest / config.max_num_batched_tokens))


def make_decode_graphs(config, model, backend, kv_caches, device: torch.device) -> "DecodeGraphs | None":
    """The runner's graphs, captured now, or None where they do not apply. The static table is as
    wide as the model's longest context."""
    if not uses_graphs(config, model.spec, backend, device):
        return None
    width = -(-model.spec.max_position_embeddings // config.block_size)
    with startup.phase("graphs"):  # the start-up breakdown ``folio serve`` logs
        return DecodeGraphs(model, backend, kv_caches, config.block_size, width, graph_buckets(config.max_num_seqs),
                            device)


class DecodeGraphs:
    def __init__(self, model, backend, kv_caches, block_size: int, max_blocks_per_seq: int, buckets: list[int],
                 device: torch.device, capture: bool = True):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size, self.buckets, self.device = block_size, buckets, device
        spec = model.spec
        self.group, self.num_kv_heads = spec.num_heads // spec.num_kv_heads, spec.num_kv_heads
        largest = buckets[-1]
        # static inputs: every graph reads (a prefix of) these
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.metas = {b: self._static_meta(b) for b in buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self._used_rows = 0  # rows from here on are padding (slot -1, length 0)
        if capture:
            self._capture_all()

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def _static_meta(self, bucket: int) -> AttentionMetadata:
        """The graph's metadata: views of the static buffers. The host lists say 'one token each,
        whole table long', so the plan (built here, before capture) covers any context the table
        can hold; the kernels read the real lengths from ``seq_lens``."""
        max_context = self.max_blocks_per_seq * self.block_size
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket], max_query_len=1,
            max_seq_len=max_context, block_size=self.block_size, query_lens_list=[1] * bucket,
            seq_lens_list=[max_context] * bucket, positions=self.positions[:bucket], padded=True)
        self.backend.plan(meta, self.group, self.num_kv_heads)
        return meta

    # ------------------------------------------------------------------ per step
    def can_run(self, step: StepInputs) -> bool:
        """A decode-only step that fits a bucket and the static table."""
        meta = step.meta
        num_seqs = len(step.rows)
        return (0 < num_seqs <= self.buckets[-1] and meta.max_query_len == 1
                and int(step.input_ids.shape[0]) == num_seqs and meta.block_tables.shape[1] <= self.max_blocks_per_seq)

    def load(self, step: StepInputs) -> int:
        """Copies the step into the static buffers, pads the rest of its bucket; returns the bucket."""
        meta = step.meta
        n = len(step.rows)
        bucket = bucket_for(n, self.buckets)
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self._used_rows > n:  # rows an earlier, larger step filled become padding again
            rows = slice(n, self._used_rows)
            self.slot_mapping[rows].fill_(-1)
            self.seq_lens[rows].zero_()
            self.positions[rows].zero_()
            self.input_ids[rows].zero_()
        self._used_rows = n
        return bucket

    def run(self, step: StepInputs) -> torch.Tensor:  # [num_seqs, hidden_size]
        bucket = self.load(step)
        n = len(step.rows)
        self.num_replays += 1
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self._forward(bucket)[:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = self.metas[bucket]
        return self.model(self.input_ids[:bucket], meta.positions, self.kv_caches, meta, self.backend)

    # ------------------------------------------------------------------ start
    @torch.inference_mode()  # as the steps run: no autograd state recorded into the graphs
    def _capture_all(self) -> None:
        """Largest bucket first, all in one memory pool (replays never overlap, so graphs may
        share their intermediate buffers)."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles kernels, builds the plan's arguments
                self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

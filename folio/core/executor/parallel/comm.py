"""Tensor parallelism: which slice of the model a rank holds (``Shard``) and how ranks talk (``Comm``).

More in docs/modules.md (folio/core/executor/parallel/comm.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The broadcast buffer of a step: most plans fit in one message; a larger one (a long new
# prompt) sends its remainder in a second broadcast of the exact size.
HEADER_BYTES = 64 * 1024
LENGTH_BYTES = 8


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``; ``Shard()`` is the whole model."""

    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's even share ``[start, end)`` of ``n`` rows or columns."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) does not divide by the tensor-parallel size {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads this rank's query heads read: a share of them, or one replicated head."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "the number of KV heads")
        if self.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {self.size} ranks")
        head = self.rank * num_kv_heads // self.size
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """``(start, end, rows)``: the ids this rank holds, and its table's rows (the last rank's
        table is padded with zero rows when the vocabulary does not divide)."""
        rows = -(-vocab_size // self.size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows


def check_shardable(spec, shard: Shard) -> None:
    """A clear error before any loading when the model cannot be split ``shard.size`` ways."""
    shard.split(spec.num_heads, "the number of attention heads")
    if not spec.num_experts or not all(spec.moe_layers):  # a dense MLP somewhere
        shard.split(spec.intermediate_size, "the intermediate size")
    if spec.num_experts:  # every rank a slice of every expert, and of the shared expert
        shard.split(spec.moe_intermediate_size, "the experts' intermediate size")
        if spec.shared_expert_intermediate_size:
            shard.split(spec.shared_expert_intermediate_size, "the shared expert's intermediate size")
    shard.kv_heads(spec.num_heads, spec.num_kv_heads)


class Comm:
    """One process group; every call is a collective that all ranks make in the same order."""

    def __init__(self, group, rank: int, size: int, device: torch.device):
        self.group, self.rank, self.size, self.device = group, rank, size, device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def all_gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension (rank order)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (others pass None): one broadcast of ``HEADER_BYTES``
        when it fits, else a second one for the remainder."""
        buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            assert data is not None
            head = data[: HEADER_BYTES - LENGTH_BYTES]
            buf[:LENGTH_BYTES] = torch.frombuffer(bytearray(len(data).to_bytes(LENGTH_BYTES, "little")),
                                                  dtype=torch.uint8)
            if head:
                buf[LENGTH_BYTES : LENGTH_BYTES + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.group.broadcast(buf, 0).wait()
        host = buf.cpu().numpy().tobytes()
        length = int.from_bytes(host[:LENGTH_BYTES], "little")
        first = host[LENGTH_BYTES : LENGTH_BYTES + min(length, HEADER_BYTES - LENGTH_BYTES)]
        rest = length - len(first)
        if rest <= 0:
            return first
        tail = torch.zeros(rest, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            tail.copy_(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8))
        self.group.broadcast(tail, 0).wait()
        return first + tail.cpu().numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (sizes first, then one padded gather)."""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        self.group.allgather([sizes], [n]).wait()
        width = max(int(s.item()) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self.group.allgather([parts], [mine]).wait()
        return [p[: int(s.item())].cpu().numpy().tobytes() for p, s in zip(parts, sizes)]


def connect(rank: int, size: int, host: str, port: int, device: torch.device, timeout_s: float = 600.0,
            store=None) -> Comm:
    """Join the group whose TCP store rank 0 serves at ``host:port`` (rank 0 may pass the store
    it made already); NCCL on a CUDA device, gloo elsewhere."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(store, rank, size)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return Comm(group, rank, size, device)


def serve_store(host: str, size: int, timeout_s: float = 600.0):
    """Rank 0's TCP store on a free port of ``host``: ``(store, port)``."""
    store = dist.TCPStore(host, 0, size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, store.port

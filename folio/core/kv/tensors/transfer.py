"""KV transfer, without its sockets: a request's KV blocks move from one executor's pool to
another's (prefill -> decode).

``KVExporter`` (the prefill side) holds exported blocks under a transfer id until the receiver
confirms, fails or the TTL passes, and answers each request with a reply and the blocks' bytes
(memoryviews of the pool); ``KVImporter`` (the decode side) pulls a handle's blocks through a
``KVChannel`` and lands them in its pool. ``KVLayout`` is the handshake both check. The ZeroMQ
sockets that carry it (CURVE over tcp) are the executor service's (``services/executor/kv_sockets.py``);
docs/operations.md (Disaggregated prefill and decode) has the protocol and its rules.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from folio.core.executor.kernels.kv_quant import scales_fingerprint
from folio.core.kv.tensors.pool import KVPool
from folio.shared.messages import TransferHandle

DEFAULT_TTL_S = 60.0
DEFAULT_TIMEOUT_S = 10.0


class TransferError(RuntimeError):
    """A pull that did not land: the sender is gone, refused it, or answered short."""


class LayoutMismatch(TransferError):
    """The two pools' layouts differ; the message names each difference."""


@dataclass(frozen=True)
class KVLayout:
    """What must agree for a block's bytes to mean the same on both sides."""

    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    kv_scales: tuple[str, ...] | None = None  # per layer of an FP8 pool: kv_quant.scales_fingerprint

    @classmethod
    def of(cls, pool: KVPool, kv_scales=None) -> "KVLayout":
        s = pool.shape
        scales = tuple(scales_fingerprint(s) for s in kv_scales) if kv_scales else None
        return cls(dtype=str(s.dtype).removeprefix("torch."), block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                   head_dim=s.head_dim, num_layers=s.num_layers, kv_scales=scales)

    def to_wire(self) -> dict:
        d = asdict(self)
        d["kv_scales"] = list(self.kv_scales) if self.kv_scales else None
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "KVLayout":
        scales = d.get("kv_scales")
        return cls(dtype=str(d["dtype"]), block_size=int(d["block_size"]), num_kv_heads=int(d["num_kv_heads"]),
                   head_dim=int(d["head_dim"]), num_layers=int(d["num_layers"]),
                   kv_scales=tuple(str(s) for s in scales) if scales else None)

    def differences(self, other: "KVLayout") -> list[str]:
        """Each field that differs, as ``name: here vs there``; empty when they match."""
        out = []
        for name in ("dtype", "block_size", "num_kv_heads", "head_dim", "num_layers"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: {a} vs {b}")
        if self.kv_scales != other.kv_scales:
            if self.kv_scales is None or other.kv_scales is None:
                out.append(f"fp8 scales: {'none' if self.kv_scales is None else 'set'} vs "
                           f"{'none' if other.kv_scales is None else 'set'}")
            else:
                bad = [i for i, (a, b) in enumerate(zip(self.kv_scales, other.kv_scales)) if a != b]
                out.append(f"fp8 scales: differ at layers {bad[:8]}" if bad else
                           f"fp8 scales: {len(self.kv_scales)} vs {len(other.kv_scales)} layers")
        return out


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive block ids as (first, count) runs, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and b >= 0 and runs[-1][0] >= 0 and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _frame_of(view: torch.Tensor) -> memoryview:
    """A pool view's bytes as a memoryview of the pool's memory (staged to host from a GPU)."""
    t = view if view.device.type == "cpu" else view.cpu()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class KVChannel(Protocol):
    """How a ``KVImporter`` reaches senders: one request on ``endpoint`` and its answer."""

    def request(self, endpoint: str, verb: bytes, header: dict, timeout_s: float) -> tuple[bytes, dict, list]:
        """(status, reply header, the reply's frames as buffers); raises ``TransferError`` on no answer."""

    def close(self) -> None: ...


class KVExporter:
    """The prefill side: holds exported blocks until confirmed and answers pulls (``answer``).
    ``endpoint``: where its socket listens, carried by each ``TransferHandle``; ``refused(what, why)``
    reports a pull by a key the transfer was not staged for."""

    def __init__(self, pool: KVPool, layout: KVLayout, endpoint: str,
                 on_release: Callable[[str, list[int], bool], None] | None = None, ttl_s: float = DEFAULT_TTL_S,
                 refused: Callable[[str, str], None] | None = None):
        self.pool, self.layout, self.ttl_s, self.endpoint = pool, layout, ttl_s, endpoint
        self.on_release, self._refused = on_release, refused
        self.outstanding: dict[str, tuple[list[int], float]] = {}  # transfer id -> (block ids, deadline)
        self._for_peer: dict[str, str] = {}  # transfer id -> the z85 key it is served to (``export``'s peer)
        self._served_to: dict[str, bytes] = {}  # transfer id -> the routing id of the peer that pulled it first
        self.counts = {"exported": 0, "confirmed": 0, "failed": 0, "expired": 0, "refused": 0, "bytes_sent": 0}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ records
    def export(self, block_ids: list[int], num_tokens: int = 0, transfer_id: str | None = None,
               peer: str | bytes | None = None) -> TransferHandle:
        """Hold ``block_ids`` under a transfer id; ``peer``: the z85 CURVE key of the only peer served it."""
        for b in block_ids:
            self.pool._check_block(b)
        tid = transfer_id or uuid.uuid4().hex
        with self._lock:
            if tid in self.outstanding:
                raise ValueError(f"transfer {tid} is already outstanding")
            self.outstanding[tid] = (list(block_ids), time.monotonic() + self.ttl_s)
            if peer:
                self._for_peer[tid] = peer.decode("ascii") if isinstance(peer, bytes) else peer
            self.counts["exported"] += 1
        return TransferHandle(transfer_id=tid, endpoint=self.endpoint, num_blocks=len(block_ids), num_tokens=num_tokens)

    def release(self, transfer_id: str, ok: bool, why: str = "failed") -> bool:
        """Drop the transfer's record and hand its blocks back to their owner (False: not outstanding)."""
        with self._lock:
            entry = self.outstanding.pop(transfer_id, None)
            self._served_to.pop(transfer_id, None)
            self._for_peer.pop(transfer_id, None)
            if entry is None:
                return False
            self.counts["confirmed" if ok else why] += 1
        if self.on_release is not None:
            self.on_release(transfer_id, entry[0], ok)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [t for t, (_, deadline) in self.outstanding.items() if deadline <= now]
        for t in late:
            self.release(t, ok=False, why="expired")
        return late

    def answer(self, who: bytes, verb: bytes, header: dict, user: str | None = None) -> tuple[bytes, dict, list]:
        """One request from peer ``who``: (status, reply header, frames). ``user``: the z85 CURVE key
        the peer authenticated with (None without CURVE)."""
        if verb in (b"CONFIRM", b"FAIL"):
            tid = str(header["transfer_id"])
            with self._lock:
                mine = self._served_to.get(tid) == who
            if mine:  # only the peer it was served to ends a transfer (another's FAIL frees nothing)
                self.release(tid, ok=verb == b"CONFIRM")
            return b"OK", {}, []
        if verb != b"PULL":
            return b"ERR", {"message": f"unknown verb {verb[:16]!r}", "kind": "bad_request"}, []
        diffs = self.layout.differences(KVLayout.from_wire(header["layout"]))
        if diffs:
            self.counts["refused"] += 1
            return b"ERR", {"message": "KV layouts differ (sender vs receiver): " + "; ".join(diffs),
                            "kind": "layout"}, []
        tid = str(header["transfer_id"])
        unknown = b"ERR", {"message": f"transfer {tid} is not outstanding (confirmed, failed or expired)",
                           "kind": "unknown"}, []
        with self._lock:
            entry = self.outstanding.get(tid)
            named = self._for_peer.get(tid)
            not_yours = entry is not None and named is not None and user != named  # staged for another key
            # served to one peer only: the first to pull it (a retry comes on that peer's same socket)
            first = self._served_to.setdefault(tid, who) if entry is not None and not not_yours else None
        if not_yours:
            self.counts["refused"] += 1
            if self._refused is not None:
                self._refused(f"kv transfer {tid[:48]}", "pulled by a key it was not staged for")
            return unknown  # the same answer as for an unknown transfer: a stranger learns nothing
        if entry is None:
            return unknown
        if first != who:
            self.counts["refused"] += 1
            return b"ERR", {"message": f"transfer {tid} is being served to another peer", "kind": "taken"}, []
        block_ids = entry[0]
        # one frame per run of consecutive blocks, per layer, K then V: slices of the pool itself
        runs = _runs(block_ids)
        out = [_frame_of(t[start:start + n]) for start, n in runs for kv in self.pool.kv_caches for t in kv]
        self.counts["bytes_sent"] += sum(f.nbytes for f in out)
        return b"OK", {"num_blocks": len(block_ids), "runs": [n for _, n in runs]}, out


class KVImporter:
    """The decode side: pulls a handle's blocks into its pool's blocks through ``channel``, then confirms."""

    def __init__(self, pool: KVPool, layout: KVLayout, channel: KVChannel, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.pool, self.layout, self.channel, self.timeout_s = pool, layout, channel, timeout_s
        self.counts = {"pulled": 0, "failed": 0, "bytes_received": 0}

    def close(self) -> None:
        self.channel.close()

    def _request(self, endpoint: str, verb: bytes, header: dict) -> tuple[dict, list]:
        status, reply, frames = self.channel.request(endpoint, verb, header, self.timeout_s)
        if status != b"OK":
            cls = LayoutMismatch if reply.get("kind") == "layout" else TransferError
            raise cls(reply.get("message", "refused"))
        return reply, frames

    def pull(self, handle: TransferHandle, block_ids: list[int]) -> int:
        """The handle's blocks into ``block_ids`` of this pool (as many); confirmed once all landed.
        Returns the bytes moved. A layout mismatch leaves the transfer with its sender; any other
        failure reports it (the sender frees the blocks) and raises."""
        if len(block_ids) != handle.num_blocks:
            raise ValueError(f"the handle holds {handle.num_blocks} blocks, {len(block_ids)} given to fill")
        header = {"transfer_id": handle.transfer_id, "layout": self.layout.to_wire()}
        try:
            reply, frames = self._request(handle.endpoint, b"PULL", header)
            if int(reply.get("num_blocks", -1)) != len(block_ids):
                raise TransferError(f"the sender holds {reply.get('num_blocks')} blocks, the handle said "
                                    f"{len(block_ids)}")
            moved = self._land(block_ids, reply, frames)
        except LayoutMismatch:
            self.counts["failed"] += 1
            raise
        except Exception as exc:
            self.counts["failed"] += 1
            try:
                self._request(handle.endpoint, b"FAIL", {"transfer_id": handle.transfer_id})
            except TransferError:
                pass  # the sender is gone, or will expire it
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"KV transfer {handle.transfer_id} failed: {exc}") from exc
        self._request(handle.endpoint, b"CONFIRM", {"transfer_id": handle.transfer_id})
        self.counts["pulled"] += 1
        self.counts["bytes_received"] += moved
        return moved

    def _land(self, block_ids, reply, frames) -> int:
        """Each frame (a run of the sender's blocks, one layer's K or V) into the receiving blocks:
        one copy per run of consecutive receiving blocks; -1 entries are skipped."""
        per_run = 2 * self.layout.num_layers
        sizes = [int(n) for n in reply.get("runs", [])]
        if sum(sizes) != len(block_ids) or len(frames) != per_run * len(sizes):
            raise TransferError(f"{len(frames)} frames in runs {sizes[:8]} for {len(block_ids)} blocks")
        caches = [t for kv in self.pool.kv_caches for t in kv]
        block_bytes = caches[0][0].numel() * caches[0].element_size()
        dst_runs, first = [], 0
        for n in sizes:
            dst_runs.append(_runs(block_ids[first:first + n]))
            first += n
        moved = 0
        for r, n in enumerate(sizes):
            for j, cache in enumerate(caches):
                buf = frames[r * per_run + j]
                if buf.nbytes != n * block_bytes:
                    raise TransferError(f"a frame of {buf.nbytes} bytes for {n} blocks of {block_bytes}")
                src = np.frombuffer(buf, dtype=np.uint8)
                offset = 0
                for start, m in dst_runs[r]:
                    if start >= 0:
                        part = src[offset * block_bytes:(offset + m) * block_bytes]
                        dst = cache[start:start + m]
                        if dst.device.type == "cpu":  # one memcpy on this thread (no thread team to wake)
                            np.copyto(dst.view(torch.uint8).numpy().reshape(-1), part)
                        else:
                            dst.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(part), non_blocking=False)
                        moved += m * block_bytes
                    offset += m
        return moved

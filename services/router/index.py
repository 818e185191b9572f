"""Which replica's prefix cache holds which blocks, as the replicas' KV events tell.

The router (``replicas.py``) feeds it each replica's numbered ``KVEventBatch``es and, when it
starts, sees a gap in the numbers, or finds a replica restarted, a ``KVSnapshot`` from that
replica's kvmanager. Routing (``routing.py``) asks how many leading blocks of a prompt a replica
holds. Pure bookkeeping: no sockets, so the tests drive it with hand-made event sequences.

Numbering: batch ``n`` follows batch ``n - 1``. A batch numbered above the one expected means
batches were lost (a slow subscriber, a reconnect): the view can no longer be trusted, so it is
marked stale and the caller asks for a snapshot. A number below the one expected means the
kvmanager started over (its counter restarted): the view is dropped and rebuilt the same way.
Until the snapshot arrives, batches are kept and replayed on top of it (those at or after its
``next_event_seq``). Only the device tier counts: a host-tier block is not a prefix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.shared.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot

DEVICE_MEDIUM = "GPU"  # what the kvmanager calls its device tier, on a CPU too
MAX_PENDING_BATCHES = 10_000  # kept while a snapshot is awaited; past that the view starts empty


@dataclass
class ReplicaView:
    block_hashes: set[bytes] = field(default_factory=set)
    block_size: int | None = None
    next_event_seq: int | None = None  # the batch expected next; None: not in sync
    take_any_next: bool = False  # no snapshot to be had: the next batch, whatever its number, syncs
    pending: list[tuple[int, KVEventBatch]] = field(default_factory=list)  # while not in sync
    num_resyncs: int = 0


class KVIndex:
    def __init__(self):
        self.views: dict[str, ReplicaView] = {}

    def view(self, replica: str) -> ReplicaView:
        return self.views.setdefault(replica, ReplicaView())

    def drop(self, replica: str) -> None:
        self.views.pop(replica, None)

    def in_sync(self, replica: str) -> bool:
        return self.view(replica).next_event_seq is not None

    # ------------------------------------------------------------------ events
    def apply_batch(self, replica: str, seq: int, batch: KVEventBatch) -> str:
        """Take one numbered batch. Returns "applied", "buffered" (waiting for a snapshot), or
        "gap" / "restart" (the view was marked stale: the caller should ask for a snapshot)."""
        view = self.view(replica)
        if view.next_event_seq is None and view.take_any_next:
            view.next_event_seq, view.take_any_next = seq, False
        if view.next_event_seq is None:
            if len(view.pending) >= MAX_PENDING_BATCHES:
                self.start_empty(replica)  # no snapshot is coming: better an empty view than none
                return self.apply_batch(replica, seq, batch)
            view.pending.append((seq, batch))
            return "buffered"
        if seq != view.next_event_seq:
            cause = "gap" if seq > view.next_event_seq else "restart"
            self.mark_stale(replica)
            view.pending.append((seq, batch))
            return cause
        self._apply(view, batch)
        view.next_event_seq = seq + 1
        return "applied"

    def _apply(self, view: ReplicaView, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                view.block_hashes.clear()
            elif isinstance(event, BlockStored) and event.medium == DEVICE_MEDIUM:
                view.block_hashes.update(event.block_hashes)
                view.block_size = event.block_size
            elif isinstance(event, BlockRemoved) and event.medium == DEVICE_MEDIUM:
                view.block_hashes.difference_update(event.block_hashes)

    # ------------------------------------------------------------------ resync
    def mark_stale(self, replica: str) -> None:
        """Forget the view: nothing is known until a snapshot (or ``start_empty``)."""
        view = self.view(replica)
        view.block_hashes.clear()
        view.next_event_seq = None
        view.take_any_next = False
        view.pending.clear()

    def apply_snapshot(self, replica: str, snapshot: KVSnapshot) -> None:
        """Replace the view with the replica's own account, then replay the batches after it."""
        view = self.view(replica)
        view.num_resyncs += 1
        view.block_hashes = set(snapshot.block_hashes)
        if snapshot.block_size:
            view.block_size = snapshot.block_size
        view.next_event_seq, view.take_any_next = snapshot.next_event_seq, False
        pending, view.pending = sorted(view.pending, key=lambda p: p[0]), []
        for seq, batch in pending:
            if seq >= view.next_event_seq:
                self.apply_batch(replica, seq, batch)

    def start_empty(self, replica: str) -> None:
        """No snapshot to be had: start from nothing and take the buffered batches as they come
        (what they store is known; what was cached before them is lost until stored again)."""
        view = self.view(replica)
        view.num_resyncs += 1
        pending, view.pending = sorted(view.pending, key=lambda p: p[0]), []
        view.block_hashes.clear()
        view.next_event_seq, view.take_any_next = None, True
        for seq, batch in pending:
            self.apply_batch(replica, seq, batch)

    # ------------------------------------------------------------------ queries
    def num_cached_blocks(self, replica: str, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its chained hashes) the replica holds."""
        held = self.view(replica).block_hashes
        num = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            num += 1
        return num

"""The KV tiers below the device pool: the disk tier's files and the cost model that decides loads.

More in docs/modules.md (folio/core/kv/tiers.py).
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
import zlib
from collections import OrderedDict
from pathlib import Path

MAGIC = b"FOLIOKV1"
_HEADER = struct.Struct("<8s16s16sQI")
HEADER_BYTES = _HEADER.size
DEFAULT_LOAD_BYTES_PER_S = 1e9
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
EMA = 0.3  # weight of the newest measurement

# a tier op's source medium in ``StepPlan.tier_saves``
DEVICE, HOST = 0, 1


def layout_id(model_identity: dict, layout: dict) -> str:
    """A stable 32-hex-digit name for (model, KV layout): equal ids, interchangeable blocks."""
    import msgspec

    blob = msgspec.json.encode({"model": model_identity, "layout": layout}, order="sorted")
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def model_identity(model_path: str, quantization: str = "auto", dtype: str = "") -> dict:
    """What names a model's weights without reading them: its config.json's bytes (hashed), its
    weight files' names and sizes, the quantization and activation dtype asked for."""
    p = Path(model_path)
    ident: dict = {"name": p.name, "quantization": quantization, "dtype": dtype}
    if p.is_dir():
        cfg = p / "config.json"
        ident["config"] = hashlib.blake2b(cfg.read_bytes(), digest_size=16).hexdigest() if cfg.exists() else ""
        ident["weights"] = sorted((f.name, f.stat().st_size) for f in p.iterdir()
                                  if f.suffix in (".safetensors", ".bin", ".gguf", ".pt") and f.is_file())
    elif p.is_file():
        ident["weights"] = [(p.name, p.stat().st_size)]
    return ident


class DiskTier:
    """One layout's folder of block files, with an in-process LRU index over it.

    ``capacity_bytes``: the most the folder may hold (the writer evicts the least recently used
    files beyond it). ``find_run``/``load`` verify a file whole before it counts; a bad file is
    deleted (``num_corrupt``)."""

    def __init__(self, root: str | os.PathLike, layout: str, capacity_bytes: int = 0, block_bytes: int = 0):
        if len(layout) != 32:
            raise ValueError(f"a layout id is 32 hex digits, got {layout!r}")
        self.root = Path(root)
        self.layout = layout
        self.layout_bytes = bytes.fromhex(layout)
        self.dir = self.root / layout
        self.capacity_bytes = int(capacity_bytes)
        self.block_bytes = block_bytes  # the payload a file must carry (0: any)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, front = least recent
        self.total_bytes = 0
        self.verified: dict[bytes, tuple] = {}  # hash -> the (size, mtime_ns, inode) verified whole
        self.counters = dict(num_disk_hits=0, num_disk_saves=0, num_disk_evictions=0, num_disk_corrupt=0,
                             num_disk_bytes_read=0, num_disk_bytes_written=0)
        self._clock = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rescan()

    # ------------------------------------------------------------------ names
    def path(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.dir / h[:2] / f"{h}.kv"

    def rescan(self) -> None:
        """Rebuild the index from the folder, least recently used (oldest mtime) first."""
        found = []
        for sub in self.dir.iterdir() if self.dir.exists() else ():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.suffix != ".kv":
                    continue
                try:
                    st = f.stat()
                    found.append((st.st_mtime_ns, bytes.fromhex(f.stem), st.st_size))
                except (OSError, ValueError):
                    continue
        found.sort()
        self.index = OrderedDict((h, size) for _, h, size in found)
        self.total_bytes = sum(self.index.values())

    def _touch(self, block_hash: bytes, path: Path) -> None:
        self._clock = max(time.time_ns(), self._clock + 1)
        try:
            os.utime(path, ns=(self._clock, self._clock))
        except OSError:
            pass
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
        seen = self.verified.get(block_hash)
        if seen is not None:
            self.verified[block_hash] = (seen[0], self._clock, seen[2])

    # ------------------------------------------------------------------ writing
    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.index or self.path(block_hash).exists()

    def refresh(self, block_hash: bytes) -> bool:
        """Whether the block's file exists; if so it becomes the most recently used."""
        path = self.path(block_hash)
        if path.exists():
            self._touch(block_hash, path)
            return True
        if block_hash in self.index:
            self.total_bytes -= self.index.pop(block_hash)
        return False

    def save(self, block_hash: bytes, payload, protect=()) -> bool:
        """Write one block's bytes under its hash (an existing file is only touched). Returns
        whether a file was written; evicts the least recently used files beyond the cap."""
        path = self.path(block_hash)
        if path.exists():
            self._touch(block_hash, path)
            return False
        mv = memoryview(payload).cast("B")
        header = _HEADER.pack(MAGIC, self.layout_bytes, block_hash, mv.nbytes, zlib.crc32(mv))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(mv)
        os.replace(tmp, path)
        size = HEADER_BYTES + mv.nbytes
        self.index[block_hash] = size
        self.total_bytes += size
        self._touch(block_hash, path)
        self.counters["num_disk_saves"] += 1
        self.counters["num_disk_bytes_written"] += size
        self.evict_to_capacity(protect)
        return True

    def evict_to_capacity(self, protect=()) -> int:
        """Delete least recently used files until the folder fits the cap (others' files too:
        the folder is rescanned first). ``protect``: hashes not to delete now."""
        if not self.capacity_bytes or self.total_bytes <= self.capacity_bytes:
            return 0
        self.rescan()
        protect = set(protect)
        n = 0
        for block_hash in list(self.index):
            if self.total_bytes <= self.capacity_bytes:
                break
            if block_hash in protect:
                continue
            self._delete(block_hash)
            self.counters["num_disk_evictions"] += 1
            n += 1
        return n

    def _delete(self, block_hash: bytes) -> None:
        try:
            self.path(block_hash).unlink()
        except OSError:
            pass
        self.total_bytes -= self.index.pop(block_hash, 0)
        self.verified.pop(block_hash, None)

    # ------------------------------------------------------------------ reading
    def read(self, block_hash: bytes) -> bytes | None:
        """The block's payload, verified (header, length, checksum); None when there is no file
        or it is bad (a bad file is deleted). A hit refreshes the file's recency."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())
        except OSError:  # gone (evicted by a process on the same folder)
            self.total_bytes -= self.index.pop(block_hash, 0)
            self.verified.pop(block_hash, None)
            return None
        payload = self._check(block_hash, data)
        if payload is None:
            self.counters["num_disk_corrupt"] += 1
            if block_hash not in self.index:
                self.index[block_hash] = len(data)
                self.total_bytes += len(data)
            self._delete(block_hash)
            return None
        if block_hash not in self.index:
            self.index[block_hash] = len(data)
            self.total_bytes += len(data)
        self.verified[block_hash] = (st.st_size, st.st_mtime_ns, st.st_ino)
        self.counters["num_disk_bytes_read"] += len(data)
        self.counters["num_disk_hits"] += 1
        self._touch(block_hash, path)
        return payload

    def _check(self, block_hash: bytes, data: bytes) -> memoryview | None:
        if len(data) < HEADER_BYTES:
            return None
        magic, layout, h, nbytes, crc = _HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER_BYTES:]
        if (magic != MAGIC or layout != self.layout_bytes or h != block_hash or nbytes != payload.nbytes
                or (self.block_bytes and nbytes != self.block_bytes) or zlib.crc32(payload) != crc):
            return None
        return payload

    def is_verified(self, block_hash: bytes) -> bool:
        """Verified whole before, and the file is still the one verified (same size, mtime, inode)."""
        seen = self.verified.get(block_hash)
        if seen is None:
            return False
        try:
            st = self.path(block_hash).stat()
        except OSError:
            self.verified.pop(block_hash, None)
            return False
        return seen == (st.st_size, st.st_mtime_ns, st.st_ino)  # (this process's touches update it)

    def find_run(self, hashes: list[bytes], tokens_per_block: int, cost: "TierCostModel | None" = None) -> list[bytes]:
        """The longest run of ``hashes``, from the first, whose files are here and verify; none when
        the cost model says recomputing them is cheaper. A bad file ends the run (and is deleted)."""
        run = []
        for h in hashes:
            path = self.path(h)
            if h not in self.index and not path.exists():
                break
            run.append(h)
        if not run:
            return []
        if cost is not None and not cost.should_load(len(run) * (self.block_bytes + HEADER_BYTES),
                                                     len(run) * tokens_per_block):
            return []
        ok = []
        t0, nbytes = time.perf_counter(), 0
        for h in run:
            if self.is_verified(h):
                ok.append(h)
                self.counters["num_disk_hits"] += 1
                self._touch(h, self.path(h))
                continue
            payload = self.read(h)
            if payload is None:
                break
            nbytes += HEADER_BYTES + payload.nbytes
            ok.append(h)
        if cost is not None and nbytes:
            cost.observe_load(nbytes, time.perf_counter() - t0)
        return ok

    def stats(self) -> dict:
        return {"disk_dir": str(self.root), "layout_id": self.layout, "num_disk_blocks": len(self.index),
                "disk_bytes": self.total_bytes, "disk_capacity_bytes": self.capacity_bytes, **self.counters}


def scan_folder(root: str | os.PathLike, layout: str) -> dict:
    """Blocks and bytes of one layout's folder (the kvmanager's stats), without an index."""
    d = Path(root) / layout
    n = size = 0
    if d.exists():
        for sub in d.iterdir():
            if sub.is_dir():
                for f in sub.iterdir():
                    if f.suffix == ".kv":
                        try:
                            size += f.stat().st_size
                            n += 1
                        except OSError:
                            pass
    return {"num_disk_blocks": n, "disk_bytes": size}


class TierCostModel:
    """Load a run of lower-tier blocks only when ``bytes / load rate < tokens / prefill rate``."""

    def __init__(self, load_bytes_per_s: float = DEFAULT_LOAD_BYTES_PER_S,
                 prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S):
        self.load_bytes_per_s = load_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s

    def load_s(self, num_bytes: int) -> float:
        return num_bytes / self.load_bytes_per_s

    def compute_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def should_load(self, num_bytes: int, num_tokens: int) -> bool:
        return self.load_s(num_bytes) < self.compute_s(num_tokens)

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.load_bytes_per_s += EMA * (num_bytes / seconds - self.load_bytes_per_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s += EMA * (num_tokens / seconds - self.prefill_tokens_per_s)

"""The chained hash that names a full KV block, shared by whoever must agree on it.

The kvmanager's allocator names every full block with it (prefix-cache lookups, KV events), and
the router hashes an incoming prompt with the same function to find which replica holds its
prefix. A block's name depends on its parent's name, its token ids and extra keys (the request's
cache salt), computed with blake2b over msgpack, never Python's ``hash()`` (salted per process).
"""

from __future__ import annotations

import hashlib

import msgspec

_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent_block_hash: bytes | None, token_ids, extra_keys: tuple = ()) -> bytes:
    """The stable name of a full block: same parent chain, tokens and extra keys, same hash."""
    # (msgpack writes a tuple as it writes a list: no copies, and the same bytes either way)
    return hashlib.blake2b(_encode((parent_block_hash, token_ids, extra_keys)), digest_size=16).digest()


def block_extra_keys(cache_salt: str | None) -> tuple:
    """The extra keys of every block of a request: its cache salt keeps tenants' caches apart."""
    return (cache_salt,) if cache_salt else ()


def chain_block_hashes(token_ids, block_size: int, extra_keys: tuple = (), known: list[bytes] = ()) -> list[bytes]:
    """The hashes of every full block of ``token_ids``; ``known``: those of its first blocks,
    already computed (they are kept, and only the blocks after them are hashed)."""
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size],
                                 extra_keys))
    return hashes

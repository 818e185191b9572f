"""The chained hash that names a full KV block, shared by whoever must agree on it.

The kvmanager's allocator names every full block with it (prefix-cache lookups, KV events), and
the router hashes an incoming prompt with the same function to find which replica holds its
prefix. A block's name depends on its parent's name, its token ids and extra keys (the request's
cache salt and LoRA adapter, and the content hash of every image whose placeholders the block
holds), computed with blake2b over msgpack, never Python's ``hash()`` (salted per process).
"""

from __future__ import annotations

import hashlib

import msgspec

_encode = msgspec.msgpack.Encoder().encode


def hash_block(parent_block_hash: bytes | None, token_ids, extra_keys: tuple = ()) -> bytes:
    """The stable name of a full block: same parent chain, tokens and extra keys, same hash."""
    # (msgpack writes a tuple as it writes a list: no copies, and the same bytes either way)
    return hashlib.blake2b(_encode((parent_block_hash, token_ids, extra_keys)), digest_size=16).digest()


_ADAPTER_MARK = "\x00lora\x00"  # starts a salt that also names an adapter (``kv_salt``)
_IMAGE_MARK = "\x00img\x00"  # starts a salt that also lists a prompt's images (``kv_salt``)


class ImageSpans(tuple):
    """A request's images as ``(offset, length, content hash)``, the last of its extra keys:
    ``block_keys`` turns it into the hashes of the images each block holds placeholders of."""


def block_keys(extra_keys: tuple, index: int, block_size: int) -> tuple:
    """The extra keys of block ``index``: the request's, with ``("image", hash)`` for every image
    whose placeholders fall in it (two prompts with the same text and different images part at
    the first block that holds an image's placeholder)."""
    if not extra_keys or type(extra_keys[-1]) is not ImageSpans:
        return extra_keys
    start, end = index * block_size, (index + 1) * block_size
    images = tuple(("image", h) for offset, length, h in extra_keys[-1] if offset < end and offset + length > start)
    return extra_keys[:-1] + images


def block_extra_keys(cache_salt: str | None, lora_name: str | None = None) -> tuple:
    """The extra keys of every block of a request: its cache salt keeps tenants' caches apart,
    its LoRA adapter (``("lora", name)``) keeps adapters' KV apart from each other and from the
    base model's. A salt made by ``kv_salt`` gives the keys of the salt, adapter and images it
    holds (the images as an ``ImageSpans``, which ``block_keys`` reads per block)."""
    images = None
    if cache_salt and cache_salt.startswith(_IMAGE_MARK):
        spans, _, cache_salt = cache_salt[len(_IMAGE_MARK):].partition("\x00")
        cache_salt = cache_salt or None
        images = ImageSpans((int(o), int(n), h) for o, n, h in (span.split(",") for span in spans.split(";")))
    if images:
        return block_extra_keys(cache_salt, lora_name) + (images,)
    if cache_salt and cache_salt.startswith(_ADAPTER_MARK):
        lora_name, _, cache_salt = cache_salt[len(_ADAPTER_MARK):].partition("\x00")
        cache_salt = cache_salt or None
    keys = (cache_salt,) if cache_salt else ()
    return keys + ("lora", lora_name) if lora_name else keys


def kv_salt(cache_salt: str | None, lora_name: str | None, images=()) -> str | None:
    """One salt string for a request's salt, adapter and images (``(offset, length, hash)``,
    the hash in hex), as the allocator's messages carry it (``KVAllocate.cache_salt``):
    ``block_extra_keys(kv_salt(s, a)) == block_extra_keys(s, a)``."""
    salt = f"{_ADAPTER_MARK}{lora_name}\x00{cache_salt or ''}" if lora_name else cache_salt
    if images:
        spans = ";".join(f"{offset},{length},{h}" for offset, length, h in images)
        salt = f"{_IMAGE_MARK}{spans}\x00{salt or ''}"
    return salt


def chain_block_hashes(token_ids, block_size: int, extra_keys: tuple = (), known: list[bytes] = ()) -> list[bytes]:
    """The hashes of every full block of ``token_ids``; ``known``: those of its first blocks,
    already computed (they are kept, and only the blocks after them are hashed)."""
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size],
                                 block_keys(extra_keys, i, block_size)))
    return hashes

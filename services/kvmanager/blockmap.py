"""The block map of the live KV page: both tiers aggregated into at most ``max_cells`` cells.

More in docs/modules.md (services/kvmanager/blockmap.py).
"""

from __future__ import annotations

import numpy as np

from folio.core.kv.allocator import BlockAllocator
from folio.core.kv.block_pool import BlockPool

DEFAULT_MAX_CELLS = 2048
MAX_CELLS_LIMIT = 8192
MAX_LISTED_SEQS = 256  # the request list of the page; the rest are counted, not listed


def _cells(pool: BlockPool, max_cells: int, with_states: bool) -> dict:
    n = pool.num_blocks
    if n == 0:
        return {"num_blocks": 0, "blocks_per_cell": 1, "num_cells": 0}
    per_cell = -(-n // max_cells)
    num_cells = -(-n // per_cell)
    pad = num_cells * per_cell - n
    refs = np.asarray(pool.ref_counts, dtype=np.int32)
    refs = np.pad(refs, (0, pad)).reshape(num_cells, per_cell)
    out = {"num_blocks": n, "blocks_per_cell": per_cell, "num_cells": num_cells}
    if not with_states:  # the host tier: used or free is all the page draws
        out["used"] = (refs > 0).sum(axis=1).tolist()
        return out
    indexed = np.zeros(num_cells * per_cell, dtype=bool)
    if pool.cached:
        indexed[np.fromiter(pool.cached.keys(), dtype=np.int64, count=len(pool.cached))] = True
    indexed = indexed.reshape(num_cells, per_cell)
    out["owned"] = (refs == 1).sum(axis=1).tolist()
    out["shared"] = (refs > 1).sum(axis=1).tolist()
    out["cached"] = ((refs == 0) & indexed).sum(axis=1).tolist()
    out["max_refs"] = refs.max(axis=1).tolist()
    return out


def block_map(allocator: BlockAllocator, max_cells: int = DEFAULT_MAX_CELLS) -> dict:
    """Both tiers as cells, and the tables of up to ``MAX_LISTED_SEQS`` requests (sizes only: a
    table itself comes from the ``seq`` verb when the page asks for it)."""
    max_cells = max(1, min(int(max_cells), MAX_CELLS_LIMIT))
    refs = allocator.device.ref_counts
    seqs = []
    for req_id, seq in allocator.seqs.items():
        if len(seqs) == MAX_LISTED_SEQS:
            break
        swapped = seq.host_block_ids is not None
        held = seq.host_block_ids if swapped else seq.held_block_ids
        seqs.append({"req_id": req_id, "num_blocks": len(held),
                     "num_shared_blocks": 0 if swapped else sum(1 for b in held if refs[b] > 1),
                     "num_tokens": seq.num_tokens, "swapped_out": swapped})
    return {"block_size": allocator.block_size, "device": _cells(allocator.device, max_cells, True),
            "host": _cells(allocator.host, max_cells, False), "seqs": seqs, "num_seqs": len(allocator.seqs)}

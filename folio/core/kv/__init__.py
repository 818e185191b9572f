"""The KV block allocator as a pure, deterministic library: block pool, allocator with the
prefix-cache index, and the step log that keeps the scheduler's replica and the kvmanager's
allocator equal; the chained block hash (``block_hash.py``, the router's too), the host and disk
tiers' bookkeeping (``tiers.py``) and a model's layer windows (``window.py``). No sockets, no
tensors; the scheduler and the kvmanager both import it."""

"""The KV block allocator as a pure, deterministic library: block pool, allocator with the
prefix-cache index, and the step log that keeps the scheduler's replica and the kvmanager's
allocator equal. No sockets, no tensors; the scheduler and the kvmanager both import it."""

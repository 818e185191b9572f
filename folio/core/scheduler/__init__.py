"""The scheduler's policy: request state, the step plan, the allocator replica, forks, beams, grammars. No torch, no sockets."""

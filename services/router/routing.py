"""Where a request goes: the replica that would compute the fewest prompt tokens, load counted.

``service.py`` calls ``choose`` once per attempt with the replicas that serve the request's model
(``ReplicaSet.serving``), the prompt's token ids (None when it could not tokenize them), its
adapter (None: the base model) and the replicas already tried. The cost of a replica is the prompt
tokens it would still have to compute (those past the prefix its cache holds, from ``KVIndex``)
plus ``load_cost_tokens`` for every request it is running or holding in its queue, plus, for a
request on an adapter, ``load_cost_tokens`` more where the adapter is not running (one request's
weight, and the tie-break: a replica running it wins against one more queued request, so an
adapter's traffic stays where its slot is until that replica is two requests busier). The
cheapest wins; among equals the next in turn after the last one chosen, so uniform traffic
spreads evenly. Block hashes are ``folio.core.kv.block_hash``'s, the kvmanager's own, with the
same extra keys (cache salt and adapter: blocks computed with different adapters never match).
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.services.router.index import KVIndex
from folio.services.router.replicas import Replica
from folio.core.kv.block_hash import block_extra_keys, chain_block_hashes

POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # "cache" (sent where its prefix is), "load" (least cost without a cached prefix), "round_robin"
    num_cached_tokens: int  # of the prompt, in the chosen replica's cache as the index saw it


class Router:
    def __init__(self, index: KVIndex, policy: str = "cache_aware", load_cost_tokens: int = 256,
                 default_block_size: int = 16):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
        self.index = index
        self.policy = policy
        self.load_cost_tokens = load_cost_tokens
        self.default_block_size = default_block_size
        self.num_choices = 0  # whose turn it is among equals (and under round_robin)

    def choose(self, replicas: list[Replica], token_ids: list[int] | None, cache_salt: str | None = None,
               exclude: set[str] = frozenset(), lora_name: str | None = None) -> Decision | None:
        live = sorted((r for r in replicas if r.up and r.name not in exclude), key=lambda r: r.name)
        if not live:
            return None
        turn = self.num_choices % len(live)
        self.num_choices += 1
        if self.policy == "round_robin":
            return Decision(live[turn], "round_robin", 0)
        cached = {r.name: 0 for r in live}
        if token_ids and self.policy == "cache_aware":
            hashes_by_size: dict[int, list[bytes]] = {}
            extra_keys = block_extra_keys(cache_salt, lora_name)
            for r in live:
                size = self.index.view(r.name).block_size or self.default_block_size
                if size not in hashes_by_size:
                    # the last prompt token is always computed: a hit never covers it
                    hashes_by_size[size] = chain_block_hashes(token_ids[:-1], size, extra_keys)
                cached[r.name] = self.index.num_cached_blocks(r.name, hashes_by_size[size]) * size
        num_tokens = len(token_ids or ())

        def cost(i: int) -> tuple:
            r = live[i]
            swap = lora_name is not None and not r.has_adapter_active(lora_name)
            return (num_tokens - cached[r.name] + self.load_cost_tokens * (r.load + swap), swap,
                    (i - turn) % len(live))

        best = live[min(range(len(live)), key=cost)]
        most_cached = max(cached.values())
        reason = "cache" if cached[best.name] and cached[best.name] == most_cached else "load"
        return Decision(best, reason, cached[best.name])

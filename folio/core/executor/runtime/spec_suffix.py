"""Suffix speculation: drafts from what earlier requests said, with no model and no training.

More in docs/modules.md (folio/core/executor/runtime/spec_suffix.py).
"""

from __future__ import annotations

from collections import OrderedDict

from folio.core.executor.runtime.spec_decode import NgramProposer, Proposal


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0  # occurrences of the substring this node spells
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences added."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0

    def _update(self, token_ids: list[int], delta: int) -> None:
        depth = self.max_depth
        for start in range(len(token_ids)):
            node = self.root
            for token in token_ids[start:start + depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.num_nodes += 1
                child.count += delta
                if child.count <= 0:  # removed: its subtree held only the removed occurrences
                    self.num_nodes -= 1 + _size(child)
                    del node.children[token]
                    break
                node = child

    def add(self, token_ids: list[int]) -> None:
        self._update(token_ids, 1)

    def remove(self, token_ids: list[int]) -> None:
        self._update(token_ids, -1)

    def _find(self, token_ids: list[int]) -> _Node | None:
        node = self.root
        for token in token_ids:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def longest_match(self, context: list[int], max_len: int | None = None) -> tuple[int, _Node | None]:
        """(length, node) of the longest suffix of ``context`` that occurs, of at most ``max_len``
        tokens (default: ``max_depth - 1``, so that something may follow it). Occurrence is
        monotone in the suffix's length (a suffix of an occurring string occurs): a binary search
        finds it."""
        cap = self.max_depth - 1 if max_len is None else min(max_len, self.max_depth - 1)
        lo, hi, best = 0, min(len(context), cap), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self._find(context[len(context) - mid:])
            if node is not None:
                lo, best = mid, node
            else:
                hi = mid - 1
        return lo, best

    def continuation(self, context: list[int], k: int, max_spec_factor: float,
                     min_token_prob: float) -> tuple[int, list[int]]:
        """(match length, the most frequent continuation of the longest matching suffix). The
        match is kept ``k`` tokens shorter than the trie is deep, so that ``k`` can follow it."""
        length, node = self.longest_match(context, max(1, self.max_depth - k))
        if node is None or length == 0:
            return 0, []
        limit = min(k, int(length * max_spec_factor), self.max_depth - length)
        out: list[int] = []
        while len(out) < limit and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            if child.count < min_token_prob * node.count:
                break
            out.append(token)
            node = child
        return length, out


def _size(node: _Node) -> int:
    total, stack = 0, list(node.children.values())
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(n.children.values())
    return total


class SuffixProposer:
    """The runner's proposer for ``{"method": "suffix"}``: point-mass drafts (verified as the
    n-gram proposer's are), from the shared trie of the request's adapter or its own tokens."""

    def __init__(self, k: int, max_depth: int = 32, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, min_n: int = 1, max_n: int = 4):
        self.k, self.max_depth = k, max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.own = NgramProposer(k, min_n, max_n)
        self.tries: dict[int, SuffixTrie] = {}  # per adapter id (0: the base model)
        self.cached: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()  # req_id -> (adapter, tokens)
        self.num_from_trie = self.num_from_own = 0

    def propose_one(self, token_ids: list[int], adapter: int = 0) -> list[int]:
        trie = self.tries.get(adapter)
        length, shared = (trie.continuation(token_ids, self.k, self.max_spec_factor, self.min_token_prob)
                          if trie is not None else (0, []))
        own = self.own.propose_one(token_ids)
        # the n-gram lookup matched at most max_n tokens: a longer shared match is the better guess
        if shared and (length > self.own.max_n or len(shared) >= len(own)):
            self.num_from_trie += 1
            return shared
        if own:
            self.num_from_own += 1
        return own

    def propose(self, states) -> list[Proposal]:
        return [Proposal(self.propose_one(s.token_ids, s.adapter)) for s in states]

    def rollback(self, req_id: str, num_valid: int) -> None:
        pass

    def drop(self, req_id: str, token_ids: list[int] | None = None, adapter: int = 0) -> None:
        """The request leaves the runner: its tokens join the shared trie (replacing what it
        left there before, if it was preempted), the oldest request's leave when full."""
        if not token_ids:
            return
        old = self.cached.pop(req_id, None)
        if old is not None:
            self.tries[old[0]].remove(old[1])
        while len(self.cached) >= self.max_cached_requests:
            _, (old_adapter, old_tokens) = self.cached.popitem(last=False)
            self.tries[old_adapter].remove(old_tokens)
        self.tries.setdefault(adapter, SuffixTrie(self.max_depth)).add(token_ids)
        self.cached[req_id] = (adapter, list(token_ids))

    def stats(self) -> dict:
        return {"suffix_cached_requests": len(self.cached),
                "suffix_trie_nodes": sum(t.num_nodes for t in self.tries.values()),
                "suffix_drafts_from_trie": self.num_from_trie, "suffix_drafts_from_own_tokens": self.num_from_own}

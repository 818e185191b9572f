"""Structured output in the scheduler: a request samples only once its grammar is compiled.

The executor compiles each grammar against the vocabulary in a worker thread
(``masks.py``). A request whose grammar it has not reported compiled is scheduled up
to, but not including, the token it samples from (its last prompt token; after a recompute, its
last token): its prefill chunks run while the grammar compiles, and no step (the others' decodes,
its own chunks) ever waits for a compile. A waiting request held that way lets the ones behind it
in the queue pass.

More in docs/modules.md (folio/core/structured/scheduling.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from folio.shared.messages import Grammar

MAX_READY_KEYS = 256  # the executor's LRU (``masks.MAX_CACHED_GRAMMARS``)


class Constrained(Protocol):
    """What the gate reads and sets on a request (the scheduler's ``Request``)."""

    req_id: str
    grammar: Grammar | None  # its structured-output grammar (None: unconstrained)
    grammar_ready: bool  # set here once its grammar is known compiled


class GrammarGate:
    def __init__(self):
        self.ready: OrderedDict[str, None] = OrderedDict()  # keys the executor reported compiled
        self.asked: set[str] = set()  # keys named in a plan, not reported yet
        self.to_ask: dict[str, Grammar] = {}  # keys for the next plan
        self.held: set[str] = set()  # this step's requests held back

    def holds(self, req: Constrained) -> bool:
        """Whether ``req`` must not sample yet, its grammar not known compiled (asking for it)."""
        grammar = req.grammar
        if grammar is None or req.grammar_ready:
            return False
        if grammar.key in self.ready:
            self.ready.move_to_end(grammar.key)
            req.grammar_ready = True
            return False
        if grammar.key not in self.asked:
            self.asked.add(grammar.key)
            self.to_ask[grammar.key] = grammar
        self.held.add(req.req_id)
        return True

    def take_step(self) -> tuple[list[Grammar], bool]:
        """The grammars to name in this step's plan, and whether a request was held back; resets
        the step's record."""
        asks, held = list(self.to_ask.values()), bool(self.held)
        self.to_ask, self.held = {}, set()
        return asks, held

    def report(self, ready: list[str], errors: dict[str, str]) -> None:
        for key in ready:
            self.asked.discard(key)
            self.ready[key] = None
            self.ready.move_to_end(key)
        while len(self.ready) > MAX_READY_KEYS:
            self.ready.popitem(last=False)
        for key in errors:
            self.asked.discard(key)
            self.ready.pop(key, None)

    def reset(self) -> None:
        self.ready.clear()
        self.asked.clear()
        self.to_ask.clear()
        self.held.clear()

"""Structured output in the executor: grammar matchers per request and the allowed-token mask.

The tokenizer service compiles each grammar once (``services/grammar.py``) and sends its
serialized form in ``SamplingParams.grammar``; here ``GrammarStore`` deserializes it once per key
(an LRU) and makes one xgrammar ``GrammarMatcher`` per request. The runner keeps the matcher on
the request's state: a fork gets its own (it is a request of its own), and a request that starts
over (preempted by recompute, its executor restarted) replays its output tokens through a fresh
matcher, so that its state always equals the tokens it has.

``apply_grammar_masks`` is the sampler's one call: before the draw, every row with a live matcher
has the tokens its grammar forbids set to -inf. Constrained rows never speculate (the runner
proposes no drafts for them), so verification never sees a grammar.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import structlog
import torch

from shared.messages import CompiledGrammar

log = structlog.get_logger()
MAX_CACHED_GRAMMARS = 256


class GrammarStore:
    """The vocabulary's ``TokenizerInfo`` and the deserialized grammars, by key. Building the
    vocabulary view takes about a second (xgrammar's import, the tokenizer): the executor service
    starts it in a background thread at start (``start_loading``); a bare runner builds it at its
    first grammar."""

    def __init__(self, model_path: str, vocab_size: int):
        self.vocab_size = vocab_size
        self._info = None
        self._error: str | None = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._loader = threading.Thread(target=self._load, args=(model_path,), name="grammar-vocab", daemon=True)
        self.stats = {"num_constrained_steps": 0, "num_constrained_rows": 0, "num_grammar_loads": 0,
                      "grammar_load_seconds_total": 0.0}

    def start_loading(self) -> None:
        if self._loader.ident is None:
            self._loader.start()

    def _load(self, model_path: str) -> None:
        try:
            from transformers import AutoTokenizer

            from services.grammar import tokenizer_info

            path = Path(model_path)
            if path.suffix == ".gguf":
                hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            else:
                hf = AutoTokenizer.from_pretrained(path)
            self._info = tokenizer_info(hf, self.vocab_size, hf.eos_token_id)
        except Exception as exc:  # a model folder without a tokenizer serves no structured output
            self._error = f"structured output needs the model's tokenizer: {exc}"

    def matcher(self, grammar: CompiledGrammar, output_token_ids: list[int]):
        """A fresh matcher for ``grammar`` that has accepted ``output_token_ids``."""
        import xgrammar as xgr

        compiled = self._compiled(grammar)
        matcher = xgr.GrammarMatcher(compiled)
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} of the output does not fit its grammar")
        return matcher

    def _compiled(self, grammar: CompiledGrammar):
        import xgrammar as xgr

        found = self._cache.get(grammar.key)
        if found is not None:
            self._cache.move_to_end(grammar.key)
            return found
        self.start_loading()
        self._loader.join()
        if self._info is None:
            raise ValueError(self._error or "structured output is unavailable")
        t0 = time.perf_counter()
        compiled = xgr.CompiledGrammar.deserialize_json(grammar.data.decode(), self._info)
        self.stats["num_grammar_loads"] += 1
        self.stats["grammar_load_seconds_total"] += time.perf_counter() - t0
        self._cache[grammar.key] = compiled
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return compiled


_BYTE_BITS = torch.tensor([[(b >> j) & 1 for j in range(8)] for b in range(256)], dtype=torch.bool)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 (bit j of word w allows token 32 w + j) -> [rows, vocab] bool.
    One table lookup per byte (little-endian words: byte k of word w holds tokens 32 w + 8 k ..),
    cheaper on a CPU than shifting every word 32 times."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [rows, 4 * words]
    return _BYTE_BITS[as_bytes].view(bitmask.shape[0], -1)[:, :vocab_size]


def grammar_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """The matchers' next-token bitmasks, one row each (on the CPU, where xgrammar fills them)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """``logits``: [rows, vocab]; ``matchers``: per row, its matcher or None. Tokens a row's
    grammar forbids become -inf; rows without a grammar (or whose grammar is done) are untouched."""
    idx = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not idx:
        return logits
    vocab = logits.shape[1]
    allowed = unpack_bitmask(grammar_bitmask([matchers[i] for i in idx], vocab), vocab).to(logits.device)
    if len(idx) == len(matchers):  # every row constrained: no gather and scatter
        return torch.where(allowed, logits, float("-inf"))
    rows = torch.tensor(idx, device=logits.device)
    logits = logits.clone()
    logits[rows] = torch.where(allowed, logits[rows], float("-inf"))
    return logits


def advance(matchers: list, token_ids: list[list[int]], req_ids: list[str]) -> None:
    """Each matcher accepts its row's new tokens. A token the grammar refuses (it cannot happen
    for a sampled token; it would take a scheduler-appended one) ends the row's constraint."""
    for matcher, tokens, req_id in zip(matchers, token_ids, req_ids):
        if matcher is None or matcher.is_terminated():
            continue
        for token_id in tokens:
            if not matcher.accept_token(token_id):
                log.warning("token outside the grammar", req_id=req_id, token_id=token_id)
                break

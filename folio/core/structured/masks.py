"""Structured output in the executor: grammars compiled against the vocabulary, a matcher per
request, and the allowed-token mask.

More in docs/modules.md (folio/core/structured/masks.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import structlog
import torch

from folio.shared.messages import Grammar

log = structlog.get_logger()
MAX_CACHED_GRAMMARS = 256
# a step with nothing to compute but a compile to wait for answers after at most this long, so that
# new requests do not wait behind a long compile
GRAMMAR_POLL_S = 0.05


class GrammarStore:
    """The vocabulary's xgrammar compiler and the compiled grammars, by key. Building the
    vocabulary view takes about a second (xgrammar's import, the tokenizer): the executor service
    starts it at start (``start_loading``); a bare runner builds it at its first grammar."""

    def __init__(self, model_path: str, vocab_size: int):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: Future | None = None
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._unclaimed: set[str] = set()  # compiles the scheduler asked for that no request used yet
        self._watched: dict[str, Future] = {}  # keys the scheduler waits to hear about
        self.failed: dict[str, str] = {}  # keys that failed at a request's sample, to report
        self._lock = threading.Lock()
        self.stats = {"num_constrained_steps": 0, "num_constrained_rows": 0, "num_grammar_compiles": 0,
                      "grammar_compile_seconds_total": 0.0, "num_grammar_cache_hits": 0,
                      "grammar_wait_seconds_total": 0.0}

    def start_loading(self) -> None:
        if self._compiler is None:
            self._compiler = self._pool.submit(self._make_compiler)

    def _make_compiler(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        from folio.core.structured.grammar import tokenizer_info

        path = Path(self.model_path)
        try:
            if path.suffix == ".gguf":
                from folio.core.gguf_file import hf_tokenizer

                hf = hf_tokenizer(path)
            else:
                hf = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # a model folder without a tokenizer serves no structured output
            raise ValueError(f"structured output needs the model's tokenizer: {exc}") from exc
        info = tokenizer_info(hf, self.vocab_size, hf.eos_token_id)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False, enable_dynamic_compilation=True)

    def prepare(self, grammar: Grammar, use: bool = True) -> Future:
        """Start compiling ``grammar`` (once per key) in the worker thread; its future. ``use``: a
        request uses it (a compile it finds started or done counts as a cache hit, unless the
        scheduler's ask started it for this very request)."""
        self.start_loading()
        with self._lock:
            future = self._compiled.get(grammar.key)
            if future is not None:
                self._compiled.move_to_end(grammar.key)
                if use and grammar.key in self._unclaimed:
                    self._unclaimed.discard(grammar.key)
                elif use:
                    self.stats["num_grammar_cache_hits"] += 1
                return future
            future = self._pool.submit(self._compile, grammar)
            self._compiled[grammar.key] = future
            if not use:
                self._unclaimed.add(grammar.key)
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._unclaimed.discard(self._compiled.popitem(last=False)[0])
            return future

    def watch(self, grammar: Grammar) -> None:
        """The scheduler waits for ``grammar``: compile it (if it is not), and name it in the next
        ``take_reports`` after its compile ended (at once when it is cached)."""
        self._watched[grammar.key] = self.prepare(grammar, use=False)

    def take_reports(self) -> tuple[list[str], dict[str, str]]:
        """The watched keys whose compile ended since the last call: (compiled, {key: why not})."""
        ready: list[str] = []
        errors, self.failed = self.failed, {}
        for key, future in list(self._watched.items()):
            if future.done():
                del self._watched[key]
                exc = future.exception()
                if exc is None:
                    ready.append(key)
                else:
                    errors[key] = compile_error(exc)
        return ready, errors

    def wait_watched(self, timeout_s: float = GRAMMAR_POLL_S) -> None:
        """Nothing else to run: wait until a watched compile ends, for at most ``timeout_s``."""
        pending = [f for f in self._watched.values() if not f.done()]
        if len(pending) == len(self._watched) and pending:
            wait(pending, timeout_s, return_when=FIRST_COMPLETED)

    def _compile(self, grammar: Grammar):
        from folio.core.structured.grammar import compile_grammar

        t0 = time.perf_counter()
        compiled = compile_grammar(self._compiler.result(), grammar)
        with self._lock:
            self.stats["num_grammar_compiles"] += 1
            self.stats["grammar_compile_seconds_total"] += time.perf_counter() - t0
        return compiled

    def matcher(self, grammar: Grammar, output_token_ids: list[int]):
        """A fresh matcher for ``grammar`` that has accepted ``output_token_ids`` (waits for the
        compile when it has not finished yet)."""
        import xgrammar as xgr

        future = self.prepare(grammar, use=False)
        if not future.done():
            t0 = time.perf_counter()
            future.result()
            self.stats["grammar_wait_seconds_total"] += time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(future.result())
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} of the output does not fit its grammar")
        return matcher


def compile_error(exc: BaseException) -> str:
    """Why a grammar did not compile here, for the request's error."""
    from folio.core.structured.grammar import error_text

    return f"the executor could not compile the request's grammar: {error_text(exc)}"


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


def grammar_prefix(matcher, token_ids: list[int]) -> int:
    """How many of ``token_ids`` (drafts) the grammar accepts in a row, stopping before one that
    would end it (the verifier needs a mask after each draft); the matcher is left as it was."""
    accepted = keep = 0
    for token_id in token_ids:
        if not matcher.accept_token(token_id):
            break
        accepted += 1
        if matcher.is_terminated():
            break
        keep += 1
    if accepted:
        matcher.rollback(accepted)
    return keep


def draft_masks(matcher, drafts: list[int], vocab_size: int) -> torch.Tensor:
    """[len(drafts) + 1, vocab] bool: what the grammar allows at each verified position (after
    drafts[:j]); the drafts must fit the grammar (``grammar_prefix``). The matcher is left as it was."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, vocab_size)
    for j in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(bitmask, j)
        if j < len(drafts):
            matcher.accept_token(drafts[j])
    if drafts:
        matcher.rollback(len(drafts))
    return unpack_bitmask(bitmask, vocab_size)


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

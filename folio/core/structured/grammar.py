"""Grammars for structured output (xgrammar): a request's spec -> a grammar, checked in the
tokenizer, compiled against the vocabulary in the executor.

- The tokenizer service holds a ``GrammarChecker``: it turns a request's ``GuidedSpec`` (a JSON
  schema, ``json_object``, a regex, a list of choices, an EBNF/GBNF grammar) into an xgrammar
  ``Grammar`` (no vocabulary needed: milliseconds even for large schemas), in a worker thread and
  once per spec (cached by a hash of it), so that a spec that cannot be compiled is a 400 naming
  the problem before anything is scheduled. The request then carries ``EngineRequest.grammar``
  (the spec and its key: a few hundred bytes, where xgrammar's serialized compiled grammar is
  tens of megabytes for a large schema).
- The executor compiles it where the vocabulary and the logits live
  (``masks.py``), once per key, with ``compile_grammar`` below.

Why xgrammar rather than llguidance: on SmolLM2's 49,152-token vocabulary (2-core CPU), filling
and advancing 64 matchers took 0.18 ms per step with xgrammar against 1.5 ms with llguidance.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from folio.shared.messages import Grammar, GuidedSpec

MAX_CACHED_GRAMMARS = 256


class GrammarError(Exception):
    """A spec that cannot be compiled; the tokenizer answers it with a 400 naming ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tokenizer_info(hf_tokenizer, vocab_size: int, eos_token_id: int | None):
    """xgrammar's view of the vocabulary: ``vocab_size`` is the model's (its logits' width, which
    may exceed the tokenizer's length), and the end of a structure is the request's EOS token."""
    import xgrammar as xgr

    stop = [eos_token_id] if eos_token_id is not None else None
    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop)


def spec_key(kind: str, spec: str) -> str:
    return hashlib.sha256(f"{kind}\0{spec}".encode()).hexdigest()[:32]


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are the choices (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# a reasoning model's think block before the constrained answer (``after_reasoning``): any text
# that does not close the block, the close, the newlines before the answer
_THINK_REGEX = r"<think>([^<]|<[^/]|</[^t])*</think>\n*"
AFTER_REASONING = "after_reasoning:"


def after_reasoning(kind: str) -> str:
    """The kind of a spec that constrains only the answer after the model's ``<think>`` block."""
    return AFTER_REASONING + kind


def build_grammar(kind: str, spec: str):
    """The xgrammar ``Grammar`` of a spec (raises on a bad one). JSON comes without free
    whitespace: a weak model could otherwise spend its whole budget on it. A kind marked
    ``after_reasoning`` lets the think block through first (the template may have opened it)."""
    import xgrammar as xgr

    if kind.startswith(AFTER_REASONING):
        think = xgr.Grammar.from_regex("(<think>)?" + _THINK_REGEX.removeprefix("<think>"))
        return xgr.Grammar.concat(think, build_grammar(kind.removeprefix(AFTER_REASONING), spec))
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(json.loads(spec)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def compile_grammar(compiler, grammar: Grammar):
    """The executor's compile: the spec's grammar against ``compiler``'s vocabulary."""
    return compiler.compile_grammar(build_grammar(grammar.kind, grammar.spec))


def check_spec(spec: GuidedSpec) -> Grammar:
    """``spec`` as the request's ``Grammar``, or ``GrammarError`` saying why it cannot be."""
    kind = spec.kind.removeprefix(AFTER_REASONING)
    if kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{spec.param} is not valid JSON: {exc}", spec.param) from None
        if not isinstance(schema, dict):
            raise GrammarError(f"{spec.param} must be a JSON schema object", spec.param)
    if kind == "choice":
        choices = json.loads(spec.spec)
        if not choices or not all(isinstance(x, str) and x for x in choices):
            raise GrammarError(f"{spec.param} must be a non-empty list of non-empty strings", spec.param)
    try:
        build_grammar(spec.kind, spec.spec)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
        raise GrammarError(f"{spec.param} cannot be compiled: {error_text(exc)}", spec.param) from exc
    return Grammar(key=spec_key(spec.kind, spec.spec), kind=spec.kind, spec=spec.spec)


class GrammarChecker:
    """Checks specs off the caller's thread, at most once per spec, and caches the results."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self.stats = {"num_grammar_checks": 0, "num_grammar_check_hits": 0, "num_grammar_errors": 0}

    def warm(self) -> Future:
        """Import xgrammar in the worker (about a second) before the first request needs it."""
        return self._pool.submit(build_grammar, "regex", "a")

    def lookup(self, spec: GuidedSpec) -> Grammar | None:
        key = spec_key(spec.kind, spec.spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.stats["num_grammar_check_hits"] += 1
            return grammar

    def submit(self, spec: GuidedSpec) -> Future:
        """A future of the checked grammar (or ``GrammarError``); requests for a spec already
        being checked share its future."""
        key = spec_key(spec.kind, spec.spec)
        with self._lock:
            if key in self._cache or key in self._inflight:
                self.stats["num_grammar_check_hits"] += 1
                if key in self._inflight:
                    return self._inflight[key]
                done: Future = Future()
                done.set_result(self._cache[key])
                return done
            future = self._pool.submit(self._check, spec, key)
            self._inflight[key] = future
            return future

    def check(self, spec: GuidedSpec) -> Grammar:
        """Blocking: the cached grammar or a fresh check (tests and offline use)."""
        return self.lookup(spec) or self.submit(spec).result()

    def _check(self, spec: GuidedSpec, key: str) -> Grammar:
        try:
            grammar = check_spec(spec)
        except GrammarError:
            with self._lock:
                self.stats["num_grammar_errors"] += 1
                self._inflight.pop(key, None)
            raise
        with self._lock:
            self.stats["num_grammar_checks"] += 1
            self._cache[key] = grammar
            self._inflight.pop(key, None)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def error_text(exc: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    text = str(exc).strip() or type(exc).__name__
    return _LOCATION.sub("", text.splitlines()[0])[:500]


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

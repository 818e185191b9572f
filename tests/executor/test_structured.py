"""The allowed-token mask of structured output against a brute-force check on a tiny vocabulary:
for every reachable state, a token is allowed exactly when the text so far plus the token can
still grow into a sentence of the language (checked with the ``regex`` module's partial matching,
independent of xgrammar), and EOS exactly when the text is a whole sentence. Also the sampler's
use of the mask, the bit unpacking, and the runner's matcher replay after a restart."""

from __future__ import annotations

import random

import pytest
import regex
import torch

xgr = pytest.importorskip("xgrammar")

from folio.core.executor.sampling.sampler import SamplingRow, sample  # noqa: E402
from folio.core.structured.masks import advance, apply_grammar_masks, unpack_bitmask  # noqa: E402
from folio.shared.messages import SamplingParams  # noqa: E402
from folio.shared.sampling import SamplingParams

EOS = 0
VOCAB = ["<eos>", "a", "b", "c", "ab", "ba", "abc", "cc", "d", "0", "1", "12", "x", "-", "-1", "aa", "bb",
         "cab", "0a", "b1", "<pad>"]
PATTERNS = [r"(ab|ba)+c?", r"[ab]{2,5}", r"-?1[0-2]*", r"c(a|b)*d", r"x|xa|xab"]


@pytest.fixture(scope="module")
def compiler():
    # the model's vocabulary is 3 wider than the tokenizer's: those slots are never allowed
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB) + 3, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1)


def brute_force(pattern: str, text: str) -> set[int]:
    allowed = {i for i, tok in enumerate(VOCAB[1:], start=1)
               if regex.fullmatch(pattern, text + tok, partial=True) is not None}
    if regex.fullmatch(pattern, text) is not None:
        allowed.add(EOS)
    return allowed


@pytest.mark.parametrize("pattern", PATTERNS)
def test_mask_equals_brute_force_on_random_walks(compiler, pattern):
    compiled = compiler.compile_regex(pattern)
    rng = random.Random(7)
    width = len(VOCAB) + 3
    for _ in range(12):  # random walks through the language, checking every state on the way
        matchers = [xgr.GrammarMatcher(compiled), None]  # the second row is unconstrained
        text = ""
        for _ in range(8):
            logits = torch.randn(2, width)
            masked = apply_grammar_masks(logits, matchers)
            allowed = set(torch.isfinite(masked[0]).nonzero().flatten().tolist())
            assert allowed == brute_force(pattern, text), (pattern, text)
            assert torch.equal(masked[1], logits[1])  # rows without a grammar are untouched
            token = rng.choice(sorted(allowed))
            advance(matchers, [[token], []], ["r0", "r1"])
            if token == EOS:
                assert matchers[0].is_terminated()
                break
            text += VOCAB[token]


def test_unpack_bitmask_bit_order():
    vocab = 70
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    expected = torch.zeros(2, vocab, dtype=torch.bool)
    for row, token in [(0, 0), (0, 31), (0, 32), (0, 69), (1, 5), (1, 40), (1, 63)]:
        word, bit = divmod(token, 32)
        bitmask[row, word] |= torch.tensor(1 << bit if bit < 31 else -(2**31), dtype=torch.int32)
        expected[row, token] = True
    assert torch.equal(unpack_bitmask(bitmask, vocab), expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_never_draws_a_forbidden_token(compiler, temperature):
    compiled = compiler.compile_regex(r"(ab|ba)+c?")
    width = len(VOCAB) + 3
    matcher = xgr.GrammarMatcher(compiled)
    text = ""
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        logits = torch.randn(1, width, generator=gen)
        logits[0, VOCAB.index("cc")] = 50.0  # the model loves a token the grammar never allows
        row = SamplingRow(SamplingParams(temperature=temperature, seed=step), None, [1], [], matcher)
        token = sample(logits, [row]).token_ids[0]
        assert token in brute_force(r"(ab|ba)+c?", text)
        advance([matcher], [[token]], ["r"])
        if token == EOS:
            break
        text += VOCAB[token]

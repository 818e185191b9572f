"""Incremental detokenization, stop strings, logprob text and the per-request mailbox of the
tokenizer service, on real SmolLM2 tokens (no sockets: ``OutputProcessor`` directly)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.core.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker, _partial_stop_len
from folio.core.tokenizer.output_processor import OutputProcessor, TokenTexts
from folio.core.tokenizer.text import RequestError
from folio.shared.messages import ChatMessage, GenerateRequest, TokenBatch, TokenDelta, TokenLogprobs
from folio.shared.sampling import SamplingParams
from tests.services.frontend import text_tokenizer

MIXED = "Hello 😀 世界 café — naïve 🧑‍🚀 done.\n  Indented ∑ 日本語のテキスト"


@pytest.fixture(scope="module")
def tok():
    return text_tokenizer()


def processor(tok) -> OutputProcessor:
    return OutputProcessor(tok.decode, TokenTexts(tok.decode_with_specials, tok.raw_bytes))


def add(tok, proc, req_id="r", prompt="Say:", stop=(), **kw) -> GenerateRequest:
    sampling = kw.pop("sampling", SamplingParams())
    if stop:
        sampling = msgspec.structs.replace(sampling, stop=list(stop))
    req = GenerateRequest(req_id=req_id, sampling=sampling, prompt=prompt, **kw)
    proc.add_request(req, tok.hf.encode(prompt), tok.eos_token_id, prompt)
    return req


def feed_one_by_one(proc, req_id, token_ids, finish_last=None, logprobs=None):
    """One TokenBatch per token, like a decode step each; returns the TextDeltas and aborts."""
    deltas, aborts = [], []
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        d = TokenDelta(req_id=req_id, token_ids=[t], finish_reason=finish_last if last else None,
                       logprobs=[logprobs(t)] if logprobs else None)
        out, ab, _ = proc.process(TokenBatch(step_id=i, deltas=[d]))
        deltas += out
        aborts += ab
    return deltas, aborts


def test_multibyte_characters_split_across_tokens_are_never_emitted_broken(tok):
    ids = tok.hf.encode(MIXED)
    # the premise: some characters really are split over several tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tok.decode, tok.hf.encode("Say:"))
    pieces = [detok.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # held back while a character was incomplete
    assert "".join(pieces) == MIXED
    assert not detok.has_pending


def test_emoji_arrives_whole_in_one_piece(tok):
    ids = tok.hf.encode("a😀b")
    detok = IncrementalDetokenizer(tok.decode, [])
    pieces = [p for p in (detok.add(t) for t in ids) if p]
    assert any("😀" in p for p in pieces)
    assert "".join(pieces) == "a😀b"


def test_stream_through_the_processor_matches_the_whole_text(tok):
    proc = processor(tok)
    add(tok, proc)
    deltas, _ = feed_one_by_one(proc, "r", tok.hf.encode(MIXED), finish_last="length")
    assert "".join(d.text for d in deltas) == MIXED
    assert all("\ufffd" not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].num_output_tokens == len(tok.hf.encode(MIXED))
    assert "r" not in proc.requests  # finished requests leave the mailbox


def test_stop_string_spanning_tokens_cuts_output_and_aborts(tok):
    text = " The answer is 42. END of the story"
    ids = tok.hf.encode(text)
    stop = "42. EN"  # spans several tokens
    assert not any(stop in tok.decode([t]) for t in ids)
    proc = processor(tok)
    add(tok, proc, stop=[stop])
    deltas, aborts = feed_one_by_one(proc, "r", ids)
    out = "".join(d.text for d in deltas)
    assert out == " The answer is "
    assert stop not in out and "42" not in out  # not even a partial prefix leaked
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert [a.reason for a in aborts] == ["stop"] and aborts[0].req_id == "r"
    # the scheduler's step was under way: its late tokens are dropped, not an error
    late, ab, unknown = proc.process(TokenBatch(step_id=99, deltas=[TokenDelta(req_id="r", token_ids=[ids[-1]])]))
    assert late == [] and ab == [] and unknown == ["r"]


def test_possible_stop_prefix_is_held_then_released(tok):
    ids = tok.hf.encode(" one two thr")
    proc = processor(tok)
    add(tok, proc, stop=["three"])
    deltas, aborts = feed_one_by_one(proc, "r", ids, finish_last="length")
    assert aborts == []
    assert all(not d.text.endswith("thr") for d in deltas[:-1])
    assert deltas[-1].text.endswith("thr")  # released at the end: it never became "three"
    assert "".join(d.text for d in deltas) == " one two thr"


def test_stop_checker_earliest_match_and_partial_suffix():
    checker = StopChecker(["world", "lo w"])
    assert checker.feed("hel") == ("he", None)  # "l" could start "lo w"
    assert checker.feed("lo") == ("l", None)  # "lo" still could
    assert checker.feed(" world") == ("", "lo w")  # starts before "world": it wins
    assert _partial_stop_len("abcwor", ["world"]) == 3
    assert _partial_stop_len("abc", ["world"]) == 0


def test_stop_token_id_and_eos_text_not_in_output(tok):
    ids = tok.hf.encode(" fine.")
    proc = processor(tok)
    add(tok, proc, req_id="s", sampling=SamplingParams(stop_token_ids=[ids[-1]]))
    deltas, _ = feed_one_by_one(proc, "s", ids, finish_last="stop")
    assert "".join(d.text for d in deltas) == " fine"
    assert deltas[-1].stop_reason == ids[-1] and deltas[-1].num_output_tokens == len(ids)
    add(tok, proc, req_id="e")
    deltas, _ = feed_one_by_one(proc, "e", ids + [tok.eos_token_id], finish_last="stop")
    assert "".join(d.text for d in deltas) == " fine."
    assert deltas[-1].stop_reason is None and deltas[-1].finish_reason == "stop"


def test_logprobs_become_token_text_with_alternatives(tok):
    ids = tok.hf.encode(" café 😀")
    proc = processor(tok)
    add(tok, proc)

    def lp(t):
        return TokenLogprobs(t, -0.5, 1, [t, 28], [-0.5, -3.0])

    deltas, _ = feed_one_by_one(proc, "r", ids, finish_last="length", logprobs=lp)
    items = [x for d in deltas for x in d.logprobs]
    assert [x.token_id for x in items] == ids
    assert [x.token for x in items] == [tok.decode_with_specials([t]) for t in ids]
    assert items[0].token == " café" and items[0].logprob == -0.5
    assert [(t.token, t.logprob, t.token_id) for t in items[0].top] == [(" café", -0.5, ids[0]), (",", -3.0, 28)]
    offsets = [x.text_offset for x in items]
    assert offsets[0] == 0 and offsets[1] == len(items[0].token)
    # the emoji's tokens show U+FFFD alone; their raw bytes join into it
    assert items[0].token_bytes is None and all(x.token_bytes for x in items if "\ufffd" in x.token)
    raw = b"".join(bytes(x.token_bytes) if x.token_bytes else x.token.encode() for x in items)
    assert raw.decode() == " café 😀"


def test_a_chosen_token_outside_the_top_n_is_added_after_them(tok):
    """OpenAI returns the chosen token's logprob always: up to n + 1 alternatives, one for n = 0."""
    texts = TokenTexts(tok.decode_with_specials, tok.raw_bytes)
    outside = texts.logprob(TokenLogprobs(30, -4.0, 3, [28, 220], [-0.5, -1.0]), 0)
    assert [(t.token_id, t.logprob) for t in outside.top] == [(28, -0.5), (220, -1.0), (30, -4.0)]
    inside = texts.logprob(TokenLogprobs(220, -1.0, 2, [28, 220], [-0.5, -1.0]), 0)
    assert [t.token_id for t in inside.top] == [28, 220]
    alone = texts.logprob(TokenLogprobs(30, -4.0, 3, [], []), 0)
    assert [(t.token, t.logprob, t.token_id) for t in alone.top] == [(alone.token, -4.0, 30)]


def test_echo_sends_prompt_text_and_prompt_logprobs_once(tok):
    proc = processor(tok)
    add(tok, proc, prompt="Hi there", echo=True)
    prompt_ids = tok.hf.encode("Hi there")
    plp = [None] + [TokenLogprobs(t, -1.0, 2, [t], [-1.0]) for t in prompt_ids[1:]]
    first = TokenDelta(req_id="r", token_ids=[28], prompt_logprobs=plp, num_prompt_tokens=len(prompt_ids))
    (d1,), _, _ = proc.process(TokenBatch(step_id=0, deltas=[first]))
    (d2,), _, _ = proc.process(TokenBatch(step_id=1, deltas=[TokenDelta(req_id="r", token_ids=[30])]))
    assert d1.prompt_text == "Hi there" and d2.prompt_text is None
    assert [x.token for x in d1.prompt_logprobs] == [tok.decode_with_specials([t]) for t in prompt_ids]
    assert d1.prompt_logprobs[0].logprob is None and d1.prompt_logprobs[1].logprob == -1.0


def test_one_text_delta_per_request_per_batch(tok):
    proc = processor(tok)
    add(tok, proc, req_id="a")
    add(tok, proc, req_id="b")
    ids = tok.hf.encode(" two words")
    batch = TokenBatch(step_id=0, deltas=[
        TokenDelta(req_id="a", token_ids=[ids[0]]),
        TokenDelta(req_id="b", token_ids=[ids[0]]),
        TokenDelta(req_id="a", token_ids=[ids[1]], finish_reason="length"),
    ])
    deltas, _, _ = proc.process(batch)
    by_id = {d.req_id: d for d in deltas}
    assert len(deltas) == 2
    assert by_id["a"].text == " two words" and by_id["a"].token_ids == ids and by_id["a"].finish_reason == "length"
    assert by_id["b"].text == " two" and by_id["b"].finish_reason is None


def test_scheduler_error_becomes_a_text_error(tok):
    proc = processor(tok)
    add(tok, proc)
    d = TokenDelta(req_id="r", token_ids=[], finish_reason="error", error="too long for the KV pool")
    (out,), _, _ = proc.process(TokenBatch(step_id=0, deltas=[d]))
    assert out.error == "too long for the KV pool" and "r" not in proc.requests


def test_chat_template_and_prompt_checks(tok):
    req = GenerateRequest(req_id="c", sampling=SamplingParams(), messages=[ChatMessage("user", "hi")])
    ids, text = tok.encode_request(req)
    assert text.startswith("<|im_start|>system")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode_with_specials(ids) == text
    bad = GenerateRequest(req_id="t", sampling=SamplingParams(), prompt_token_ids=[1, tok.vocab_size])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tok.encode_request(bad)
    long_req = GenerateRequest(req_id="l", sampling=SamplingParams(max_tokens=tok.max_model_len), prompt="x")
    with pytest.raises(RequestError, match="maximum context length") as info:
        tok.fit_max_tokens(long_req, 5)
    assert info.value.param == "max_tokens"
    fill = GenerateRequest(req_id="f", sampling=SamplingParams(max_tokens=None), messages=[ChatMessage("user", "hi")])
    assert tok.fit_max_tokens(fill, 100) == tok.max_model_len - 100
    with pytest.raises(RequestError, match="maximum context length") as info:
        tok.fit_max_tokens(fill, tok.max_model_len)  # a prompt that leaves nothing
    assert info.value.param == "messages"
    with pytest.raises(RequestError, match="empty"):
        tok.fit_max_tokens(long_req, 0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40),
       stop=st.text(alphabet="ab é😀", min_size=1, max_size=3))
def test_any_text_streams_back_whole_and_stops_exactly(tok, text, stop):
    """Property: token by token, the pieces never hold a broken character and join to the text;
    with a stop string, the output is exactly the text before its first occurrence."""
    ids = tok.hf.encode(text)
    if tok.decode(ids) != text:  # the tokenizer itself does not round-trip this text
        return
    proc = processor(tok)
    add(tok, proc, stop=[stop])
    deltas, aborts = feed_one_by_one(proc, "r", ids, finish_last="length")
    out = "".join(d.text for d in deltas)
    assert all("\ufffd" not in d.text for d in deltas) or "\ufffd" in text
    if stop in text:
        assert out == text[: text.index(stop)] and deltas[-1].stop_reason == stop
    else:
        assert out == text and deltas[-1].finish_reason == "length"

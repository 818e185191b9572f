"""The tokenizer's one-pass step (``OutputProcessor.process``) gives exactly the text of the
general per-token fold it shortcuts: random steps of many requests (characters split across
tokens, stop strings, logprobs, echo, n > 1 choices of one prompt, several tokens per delta and
several deltas per request in one step, plain deltas sent flat, EOS and length finishes) go
through a processor that takes the short path and one that never does; every batch must come out
identical."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.core.tokenizer.output_processor import OutputProcessor, TokenTexts
from folio.shared.messages import GenerateRequest, TokenBatch, TokenDelta, TokenLogprobs
from folio.shared.sampling import SamplingParams
from tests.services.frontend import text_tokenizer

PIECES = ["Hello", " 😀", " 世界", " café", " —", " naïve", " 🧑‍🚀", " END", "\n", " stop", "ST", "OP", " ∑", "日本語"]


@pytest.fixture(scope="module")
def tok():
    return text_tokenizer()


class GeneralOnly(OutputProcessor):
    """Every delta through the general fold (``_apply``): what ``process`` did for every delta
    before it had a short path."""

    def _text_delta(self, state, out):
        delta = super()._text_delta(state, out)
        state.plain = False
        return delta


def processors(tok) -> tuple[OutputProcessor, OutputProcessor]:
    def make(cls):
        return cls(tok.decode, TokenTexts(tok.decode_with_specials, tok.raw_bytes))

    return make(OutputProcessor), make(GeneralOnly)


request_specs = st.fixed_dictionaries({
    "text": st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join),
    "stop": st.sampled_from([[], [], ["END"], ["STOP", "\n"], ["世界"]]),
    "logprobs": st.sampled_from([None, None, 2]),
    "echo": st.booleans(),
    "n": st.integers(1, 3),
    "finish": st.sampled_from(["length", "stop"]),
})


def _logprobs(token_id: int, num_top: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -0.5, 1, [token_id, 28][:num_top], [-0.5, -1.5][:num_top])


def _steps(tok, specs, data) -> list[TokenBatch]:
    """Random steps: each running choice gets 0-3 tokens, sometimes in two deltas of one batch."""
    remaining = {}
    for i, spec in enumerate(specs):
        ids = tok.hf.encode(spec["text"], add_special_tokens=False)
        if spec["finish"] == "stop":
            ids = ids + [tok.eos_token_id]
        for c in range(spec["n"]):
            remaining[f"r{i}-{c}"] = (list(ids[c:] or ids), spec)
    batches, step_id = [], 0
    while remaining:
        deltas, plain_req_ids, plain_token_ids = [], [], []
        for req_id in list(remaining):
            ids, spec = remaining[req_id]
            mine = []
            for _ in range(data.draw(st.sampled_from([1, 1, 1, 2, 0]), label="num deltas")):
                if not ids:
                    break
                take = data.draw(st.sampled_from([1, 1, 1, 2, 3]), label="num tokens")
                token_ids, ids = ids[:take], ids[take:]
                lps = [_logprobs(t, spec["logprobs"]) for t in token_ids] if spec["logprobs"] else None
                mine.append(TokenDelta(req_id=req_id, token_ids=token_ids, logprobs=lps,
                                       finish_reason=None if ids else spec["finish"],
                                       num_prompt_tokens=4 if step_id == 0 else 0))
            # as the scheduler sends them: a lone delta of one token and nothing else may go flat
            if (len(mine) == 1 and len(mine[0].token_ids) == 1 and mine[0].logprobs is None and step_id
                    and mine[0].finish_reason is None and data.draw(st.booleans(), label="flat")):
                plain_req_ids.append(req_id)
                plain_token_ids.append(mine[0].token_ids[0])
            else:
                deltas += mine
            remaining[req_id] = (ids, spec)
            if not ids:
                del remaining[req_id]
        batches.append(TokenBatch(step_id=step_id, deltas=deltas, plain_req_ids=plain_req_ids,
                                  plain_token_ids=plain_token_ids))
        step_id += 1
    return batches


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])
@given(specs=st.lists(request_specs, min_size=1, max_size=5), data=st.data())
def test_one_pass_step_gives_exactly_the_general_fold_output(tok, specs, data):
    fast, general = processors(tok)
    for i, spec in enumerate(specs):
        prompt = "Say: 😀"
        prompt_ids = tok.hf.encode(prompt)
        for c in range(spec["n"]):
            req = GenerateRequest(req_id=f"r{i}-{c}", prompt=prompt, echo=spec["echo"],
                                  sampling=SamplingParams(logprobs=spec["logprobs"], stop=spec["stop"]))
            for proc in (fast, general):
                proc.add_request(req, prompt_ids, tok.eos_token_id, prompt)
    texts: dict[str, str] = {}
    for batch in _steps(tok, specs, data):
        got, want = fast.process(batch), general.process(batch)
        assert got == want
        for delta in got[0]:
            texts[delta.req_id] = texts.get(delta.req_id, "") + delta.text
    assert fast.requests.keys() == general.requests.keys()
    for i, spec in enumerate(specs):  # and the text is the whole text, cut at the first stop string
        whole = spec["text"]
        cut = min((whole.find(s) for s in spec["stop"] if s in whole), default=len(whole))
        assert texts.get(f"r{i}-0", "") == whole[:cut]


def test_the_short_path_is_taken_for_plain_decode_steps(tok):
    """The premise of the property test: plain one-token steps do take the short path (a
    processor whose short path is never taken would make the comparison empty)."""
    fast, _ = processors(tok)
    calls = []
    fast._apply = lambda *args: calls.append(args) or OutputProcessor._apply(fast, *args)
    req = GenerateRequest(req_id="a", prompt="Hi", sampling=SamplingParams())
    fast.add_request(req, tok.hf.encode("Hi"), tok.eos_token_id, "Hi")
    ids = tok.hf.encode(" one two three", add_special_tokens=False)
    for step, token_id in enumerate(ids):
        fast.process(TokenBatch(step_id=step, deltas=[TokenDelta(req_id="a", token_ids=[token_id])]))
    assert len(calls) == 1  # only the first step (it carries the request's first delta)
    for step, token_id in enumerate(ids):  # flat, as the scheduler sends plain deltas
        fast.process(TokenBatch(step_id=step, plain_req_ids=["a"], plain_token_ids=[token_id]))
    assert len(calls) == 1

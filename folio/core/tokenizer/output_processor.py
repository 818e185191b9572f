"""Per-request output state of the tokenizer service: token batches in, text batches out.

The tokenizer service (``service.py``) registers each request here once it is encoded, feeds every
``TokenBatch`` from the scheduler through ``OutputProcessor.process`` and sends back what it
returns: ONE ``TextBatch`` for the gateway per incoming ``TokenBatch`` (each request's deltas of
that batch merged into one ``TextDelta``, its mailbox), plus an ``AbortRequest(reason="stop")`` for
the scheduler for each request that hit a stop string. A continuation (``forced_token_ids``) starts
from the state its original had after those tokens (``_resume``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from folio.core.tokenizer.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopChecker
from folio.shared.messages import (
    AbortRequest,
    GenerateRequest,
    TextDelta,
    TextLogprob,
    TokenBatch,
    TokenDelta,
    TokenLogprobs,
    TopLogprob,
)


class TokenTexts:
    """Token id -> its text alone, for logprobs (special tokens shown); cached, the vocabulary is
    small and the same tokens come back all the time. A token that holds part of a multi-byte
    character also gets its raw bytes (``raw_bytes``), which OpenAI's chat logprobs carry so a
    client can join such tokens into the character."""

    def __init__(self, decode_with_specials, raw_bytes=None):
        self._decode = decode_with_specials
        self._raw_bytes = raw_bytes or (lambda token_id: None)
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> str:
        return self.text_and_bytes(token_id)[0]

    def text_and_bytes(self, token_id: int) -> tuple[str, list[int] | None]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self._decode([token_id])
            raw = self._raw_bytes(token_id) if REPLACEMENT_CHAR in text else None
            entry = self._cache[token_id] = (text, list(raw) if raw is not None else None)
        return entry

    def logprob(self, lp: TokenLogprobs, text_offset: int) -> TextLogprob:
        """The chosen token always appears among ``top`` (OpenAI: "the API will always return the
        logprob of the sampled token"), after the top-n when it is not one of them: up to n + 1
        entries, and exactly one for ``logprobs=0`` (what lm-eval's loglikelihood requests read)."""
        top = []
        for token_id, value in zip(lp.top_token_ids, lp.top_logprobs):
            text, raw = self.text_and_bytes(token_id)
            top.append(TopLogprob(text, value, token_id, raw))
        text, raw = self.text_and_bytes(lp.token_id)
        if lp.token_id not in lp.top_token_ids:
            top.append(TopLogprob(text, lp.logprob, lp.token_id, raw))
        return TextLogprob(token=text, token_id=lp.token_id, logprob=lp.logprob, top=top, text_offset=text_offset,
                           token_bytes=raw, rank=lp.rank)


@dataclass
class RequestTextState:
    req: GenerateRequest
    prompt_token_ids: list[int]
    prompt_text: str | None  # set when echo asks for it
    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    eos_token_id: int | None
    text_offset: int = 0  # of the next output token's text, for completions logprobs
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    sent_first: bool = False
    # its next token needs only detokenizing: the first delta (echo) went out, no stop strings
    plain: bool = False

    @property
    def req_id(self) -> str:
        return self.req.req_id

    def ends_on_stop_token(self, delta: TokenDelta) -> bool:
        """The scheduler stopped on EOS or a stop token id: that token's text is not output."""
        if delta.finish_reason != "stop" or not delta.token_ids:
            return False
        last = delta.token_ids[-1]
        sp = self.req.sampling
        return last in sp.stop_token_ids or (last == self.eos_token_id and not sp.ignore_eos)


@dataclass
class _Pending:
    """One request's merged output within one TokenBatch."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TextLogprob] | None = None
    prompt_logprobs: list[TextLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: int = 400
    queue_time_s: float | None = None
    pooled: bytes | None = None


class OutputProcessor:
    def __init__(self, decode, token_texts: TokenTexts):
        self._decode = decode  # list[int] -> str, special tokens skipped
        self._texts = token_texts
        self.requests: dict[str, RequestTextState] = {}

    def add_request(self, req: GenerateRequest, prompt_token_ids: list[int], eos_token_id: int | None,
                    prompt_text: str | None) -> None:
        echo_text = (prompt_text if prompt_text is not None else self._decode(prompt_token_ids)) if req.echo else None
        state = self.requests[req.req_id] = RequestTextState(
            req=req,
            prompt_token_ids=prompt_token_ids,
            prompt_text=echo_text,
            detokenizer=IncrementalDetokenizer(self._decode, prompt_token_ids),
            stop=StopChecker(req.sampling.stop),
            eos_token_id=eos_token_id,
            text_offset=len(echo_text) if echo_text else 0,
            num_prompt_tokens=len(prompt_token_ids),
        )
        if req.forced_token_ids:
            self._resume(state, req.forced_token_ids)

    def _resume(self, state: RequestTextState, forced: list[int]) -> None:
        """A continuation: the state its original request had after ``forced``, whose text (and
        echo, and logprobs) the client has already. The detokenizer and the stop checker take the
        tokens as they did then (their held-back tails come out with the tokens that follow);
        nothing is emitted."""
        wants_offsets = state.req.sampling.engine_logprobs is not None  # as the engine reports them
        for token_id in forced:
            state.stop.feed(state.detokenizer.add(token_id))
            if wants_offsets:
                state.text_offset += len(self._texts(token_id))
        state.num_output_tokens = len(forced)
        state.sent_first = True
        state.plain = not state.stop.active

    def add_choices(self, req: GenerateRequest, prompt_token_ids: list[int], eos_token_id: int | None,
                    prompt_text: str | None) -> None:
        """Register ``req`` and its forked choices (``fork_req_ids``): they share the prompt, not
        the text state."""
        for choice_id in (req.req_id, *req.fork_req_ids):
            choice = req if choice_id == req.req_id else msgspec.structs.replace(req, req_id=choice_id, fork_req_ids=[])
            self.add_request(choice, prompt_token_ids, eos_token_id, prompt_text)

    def remove(self, req_id: str) -> RequestTextState | None:
        return self.requests.pop(req_id, None)

    def process(self, batch: TokenBatch) -> tuple[list[TextDelta], list[AbortRequest], list[str]]:
        """(text deltas for the gateway, stop-string aborts for the scheduler, unknown req ids).

        One pass over the step's deltas. Most of them are one decoded token of a running request
        (the batch's flat plain arrays) that needs nothing but its text (no stop strings, logprobs
        or echo): those take a short path straight to their ``TextDelta``; the others fold through
        ``_apply``, which gives the same text for the same tokens.

        Unknown ids are normal right after a stop string or a client abort: the scheduler's step
        was already under way when it heard of it.
        """
        outputs: dict[str, TextDelta | _Pending] = {}
        aborts: list[AbortRequest] = []
        unknown: list[str] = []
        requests = self.requests
        for req_id, token_id in zip(batch.plain_req_ids, batch.plain_token_ids):
            state = requests.get(req_id)
            if state is None:
                unknown.append(req_id)
            elif state.plain and req_id not in outputs:
                state.num_output_tokens += 1
                outputs[req_id] = TextDelta(
                    req_id=req_id, text=state.detokenizer.add(token_id), token_ids=[token_id],
                    num_prompt_tokens=state.num_prompt_tokens, num_output_tokens=state.num_output_tokens,
                    num_cached_tokens=state.num_cached_tokens)
            else:
                self._fold(state, TokenDelta(req_id=req_id, token_ids=[token_id]), outputs, aborts)
        for delta in batch.deltas:
            state = requests.get(delta.req_id)
            if state is None:
                unknown.append(delta.req_id)
                continue
            req_id, token_ids = delta.req_id, delta.token_ids
            if (state.plain and req_id not in outputs and len(token_ids) == 1 and delta.finish_reason is None
                    and delta.logprobs is None and delta.prompt_logprobs is None and delta.queue_time_s is None
                    and not delta.num_prompt_tokens):
                state.num_output_tokens += 1
                outputs[req_id] = TextDelta(
                    req_id=req_id, text=state.detokenizer.add(token_ids[0]), token_ids=token_ids,
                    num_prompt_tokens=state.num_prompt_tokens, num_output_tokens=state.num_output_tokens,
                    num_cached_tokens=state.num_cached_tokens)
                continue
            self._fold(state, delta, outputs, aborts)
        deltas = [out if isinstance(out, TextDelta) else self._text_delta(requests[req_id], out)
                  for req_id, out in outputs.items()]
        for req_id, out in outputs.items():
            if out.finish_reason is not None:
                del requests[req_id]
        return deltas, aborts, unknown

    def _fold(self, state: RequestTextState, delta: TokenDelta, outputs: dict, aborts: list[AbortRequest]) -> None:
        """``process`` for a delta off its short path: fold it into the request's pending output."""
        req_id = delta.req_id
        out = outputs.get(req_id)
        if out is None:
            out = outputs[req_id] = _Pending()
        elif isinstance(out, TextDelta):  # its second delta in this batch: fold the first in
            out = outputs[req_id] = _Pending(text=[out.text], token_ids=list(out.token_ids))
        if out.finish_reason is not None:
            return  # finished earlier in this same batch (a stop string)
        if self._apply(state, delta, out) and delta.finish_reason is None:
            aborts.append(AbortRequest(req_id=req_id, reason="stop"))

    def _apply(self, state: RequestTextState, delta: TokenDelta, out: _Pending) -> bool:
        """Fold one TokenDelta into ``out``; True when a stop string ended the request."""
        if delta.num_prompt_tokens:
            state.num_prompt_tokens = delta.num_prompt_tokens
            state.num_cached_tokens = delta.num_cached_tokens
        if delta.queue_time_s is not None:
            out.queue_time_s = delta.queue_time_s
        if delta.finish_reason == "error":  # the scheduler refused it (too long for the context/pool, draining)
            out.finish_reason, out.error = "error", delta.error or "the scheduler refused the request"
            out.error_code = delta.error_code
            return False
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = self._prompt_logprobs(state, delta.prompt_logprobs)
        if delta.pooled is not None:
            out.pooled = delta.pooled
        skip_last = state.ends_on_stop_token(delta)
        num_tokens = len(delta.token_ids)
        for i, token_id in enumerate(delta.token_ids):
            state.num_output_tokens += 1
            out.token_ids.append(token_id)
            if delta.logprobs is not None and i < len(delta.logprobs):
                lp = self._texts.logprob(delta.logprobs[i], state.text_offset)
                state.text_offset += len(lp.token)
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.append(lp)
            if skip_last and i == num_tokens - 1:
                break
            text, matched = state.stop.feed(state.detokenizer.add(token_id))
            out.text.append(text)
            if matched is not None:
                out.finish_reason, out.stop_reason = "stop", matched
                return True
        if delta.finish_reason is not None:
            out.text.append(state.stop.flush())
            out.finish_reason = delta.finish_reason
            if skip_last and delta.token_ids[-1] in state.req.sampling.stop_token_ids:
                out.stop_reason = delta.token_ids[-1]
        return False

    def _prompt_logprobs(self, state: RequestTextState, lps: list[TokenLogprobs | None]) -> list[TextLogprob]:
        result, offset = [], 0
        for token_id, lp in zip(state.prompt_token_ids, lps):
            if lp is None:  # the first prompt token has no logprob
                text, raw = self._texts.text_and_bytes(token_id)
                item = TextLogprob(token=text, token_id=token_id, logprob=None, text_offset=offset, token_bytes=raw)
            else:
                item = self._texts.logprob(lp, offset)
            offset += len(item.token)
            result.append(item)
        return result

    def _text_delta(self, state: RequestTextState, out: _Pending) -> TextDelta:
        prompt_text = None
        if not state.sent_first:
            state.sent_first = True
            state.plain = not state.stop.active
            prompt_text = state.prompt_text
        return TextDelta(
            req_id=state.req_id,
            text="".join(out.text),
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            prompt_text=prompt_text,
            prompt_logprobs=out.prompt_logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.num_cached_tokens,
            error=out.error,
            error_code=out.error_code,
            queue_time_s=out.queue_time_s,
            pooled=out.pooled,
        )

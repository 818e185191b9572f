"""Per-HTTP-request output mailboxes: where the gateway's socket reader leaves text deltas for the
handler that writes the response.

``GatewayService.handle_text_batch`` puts every ``TextDelta`` into the mailbox of its HTTP request;
the route handler (``streaming.py``) takes everything that piled up in one go. A slow reader (a
client draining its SSE stream slowly) never blocks the socket reader and never grows a queue:
deltas of the same choice merge into one (vLLM V1's ``RequestOutputCollector`` idea). They are
kept as a short list and joined once when the reader takes them, so that a step costs the socket
reader an append per delta, not a rebuilt delta.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from folio.shared.messages import TextDelta

MAX_UNMERGED = 64  # deltas of one choice kept apart before they are merged anyway


def merge_deltas(a: TextDelta, b: TextDelta) -> TextDelta:
    """``a`` then ``b`` of the same request as one delta."""
    return merge_all([a, b])


def merge_all(deltas: list[TextDelta]) -> TextDelta:
    """Several deltas of the same request, in order, as one (joined once, not pairwise, in one
    pass: a gateway that fell behind merges every stream's deltas at every step). Texts, token
    ids and logprobs concatenate; the first prompt text, prompt logprobs and queue time win; the
    last finish reason, stop reason and error win; token counts take their largest value."""
    if len(deltas) == 1:
        return deltas[0]
    first = deltas[0]
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs = prompt_text = prompt_logprobs = finish_reason = stop_reason = failed = queue_time_s = pooled = None
    num_prompt, num_output, num_cached = first.num_prompt_tokens, first.num_output_tokens, first.num_cached_tokens
    for d in deltas:
        texts.append(d.text)
        token_ids += d.token_ids
        if d.logprobs is not None:
            if logprobs is None:
                logprobs = list(d.logprobs)
            else:
                logprobs += d.logprobs
        if prompt_text is None:
            prompt_text = d.prompt_text
        if prompt_logprobs is None:
            prompt_logprobs = d.prompt_logprobs
        if queue_time_s is None:
            queue_time_s = d.queue_time_s
        if d.finish_reason:
            finish_reason = d.finish_reason
        if d.pooled is not None:
            pooled = d.pooled
        if d.stop_reason is not None:
            stop_reason = d.stop_reason
        if d.error:
            failed = d
        if d.num_prompt_tokens > num_prompt:
            num_prompt = d.num_prompt_tokens
        if d.num_output_tokens > num_output:
            num_output = d.num_output_tokens
        if d.num_cached_tokens > num_cached:
            num_cached = d.num_cached_tokens
    return TextDelta(
        req_id=first.req_id, text="".join(texts), token_ids=token_ids, logprobs=logprobs, prompt_text=prompt_text,
        prompt_logprobs=prompt_logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
        num_prompt_tokens=num_prompt, num_output_tokens=num_output, num_cached_tokens=num_cached,
        error=failed.error if failed else None, error_code=(failed or first).error_code,
        error_param=(failed or first).error_param, queue_time_s=queue_time_s, pooled=pooled,
    )


@dataclass
class ChoiceTiming:
    """When one choice's tokens arrived, for the latency histograms."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class OutputMailbox:
    """The pending deltas of one HTTP request's choices, keyed by choice index."""

    def __init__(self, req_ids: list[str]):
        self.index = {req_id: i for i, req_id in enumerate(req_ids)}
        now = time.monotonic()
        self.timing = {req_id: ChoiceTiming(arrival=now) for req_id in req_ids}
        self.unfinished = set(req_ids)
        self._pending: dict[int, list[TextDelta]] = {}
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits in ``get``
        self.lora_name: str | None = None  # the LoRA adapter its requests run with
        # what a replay needs (``GatewayService.replay``): the requests as submitted, each choice's
        # tokens delivered so far, and how many times it was replayed
        self.reqs: list = []
        self.token_ids: dict[str, list[int]] = {req_id: [] for req_id in req_ids}
        self.num_replays = 0  # in a row, without a token delivered in between
        self.num_delivered_at_replay = 0
        self.num_replays_total = 0

    def put(self, delta: TextDelta) -> None:
        if delta.token_ids:
            self.token_ids[delta.req_id] += delta.token_ids
        pending = self._pending.get(self.index[delta.req_id])
        if pending is None:
            self._pending[self.index[delta.req_id]] = [delta]
        elif len(pending) < MAX_UNMERGED:
            pending.append(delta)  # merged once, when the reader takes them
        else:  # a reader that stalls (a slow client) holds one merged delta, not a growing list
            pending[:] = [merge_all([*pending, delta])]
        if delta.finish_reason is not None:
            self.unfinished.discard(delta.req_id)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> dict[int, TextDelta]:
        """Everything that arrived since the last call, one merged delta per choice (waits while
        nothing did)."""
        if not self._pending:  # a bare future: the reader is woken once per step at most
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out, self._pending = self._pending, {}
        if len(out) == 1:  # one choice (most streams): no comprehension
            ((index, deltas),) = out.items()
            return {index: deltas[0] if len(deltas) == 1 else merge_all(deltas)}
        return {i: merge_all(deltas) for i, deltas in out.items()}

    @property
    def done(self) -> bool:
        return not self.unfinished and not self._pending

"""Per-HTTP-request output mailboxes: where the gateway's socket reader leaves text deltas for the
handler that writes the response.

``GatewayService.handle_text_batch`` puts every ``TextDelta`` into the mailbox of its HTTP request;
the route handler (``streaming.py``) takes everything that piled up in one go. A slow reader (a
client draining its SSE stream slowly) never blocks the socket reader and never grows a queue:
deltas of the same choice merge into one (vLLM V1's ``RequestOutputCollector`` idea).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from shared.messages import TextDelta


def merge_deltas(a: TextDelta, b: TextDelta) -> TextDelta:
    """``a`` then ``b`` of the same request as one delta."""

    def cat(x, y):
        return y if x is None else x if y is None else x + y

    return TextDelta(
        req_id=a.req_id,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=cat(a.logprobs, b.logprobs),
        prompt_text=a.prompt_text if a.prompt_text is not None else b.prompt_text,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        finish_reason=b.finish_reason or a.finish_reason,
        stop_reason=b.stop_reason if b.stop_reason is not None else a.stop_reason,
        num_prompt_tokens=max(a.num_prompt_tokens, b.num_prompt_tokens),
        num_output_tokens=max(a.num_output_tokens, b.num_output_tokens),
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
        error=b.error or a.error,
        error_code=b.error_code if b.error else a.error_code,
        error_param=b.error_param if b.error else a.error_param,
        queue_time_s=a.queue_time_s if a.queue_time_s is not None else b.queue_time_s,
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
        self._pending: dict[int, TextDelta] = {}
        self._ready = asyncio.Event()

    def put(self, delta: TextDelta) -> None:
        i = self.index[delta.req_id]
        prev = self._pending.get(i)
        self._pending[i] = delta if prev is None else merge_deltas(prev, delta)
        if delta.finish_reason is not None:
            self.unfinished.discard(delta.req_id)
        self._ready.set()

    async def get(self) -> dict[int, TextDelta]:
        """Everything that arrived since the last call (waits while nothing did)."""
        await self._ready.wait()
        self._ready.clear()
        out, self._pending = self._pending, {}
        return out

    @property
    def done(self) -> bool:
        return not self.unfinished and not self._pending

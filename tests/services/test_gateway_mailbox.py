"""The gateway's per-request mailbox: deltas that piled up while the reader was away come out as
one delta per choice (joined once), and a reader that stalls holds a bounded list."""

from __future__ import annotations

import asyncio
import random

from folio.services.gateway.mailbox import MAX_UNMERGED, OutputMailbox, merge_all
from folio.shared.messages import TextDelta, TextLogprob


def _lp(token_id: int) -> TextLogprob:
    return TextLogprob(token=str(token_id), token_id=token_id, logprob=-1.0)


def test_piled_up_deltas_come_out_as_one_per_choice():
    async def main():
        box = OutputMailbox(["a", "b"])
        box.put(TextDelta(req_id="a", text="He", token_ids=[1], prompt_text="P", num_prompt_tokens=3,
                          num_output_tokens=1, queue_time_s=0.5, logprobs=[_lp(1)]))
        box.put(TextDelta(req_id="b", text="x", token_ids=[9], num_output_tokens=1))
        box.put(TextDelta(req_id="a", text="llo", token_ids=[2, 3], num_output_tokens=3, num_cached_tokens=2))
        box.put(TextDelta(req_id="a", text="!", token_ids=[4], num_output_tokens=4, finish_reason="stop",
                          stop_reason="END", logprobs=[_lp(4)]))
        out = await box.get()
        a, b = out[0], out[1]
        assert (a.text, a.token_ids, a.prompt_text, a.finish_reason, a.stop_reason) == ("Hello!", [1, 2, 3, 4], "P",
                                                                                        "stop", "END")
        assert (a.num_prompt_tokens, a.num_output_tokens, a.num_cached_tokens, a.queue_time_s) == (3, 4, 2, 0.5)
        assert [lp.token_id for lp in a.logprobs] == [1, 4]
        assert (b.text, b.token_ids, b.finish_reason) == ("x", [9], None)
        assert box.unfinished == {"b"} and not box.done

    asyncio.run(main())


def test_an_error_after_text_wins_and_a_stalled_reader_holds_a_bounded_list():
    async def main():
        box = OutputMailbox(["a"])
        for i in range(3 * MAX_UNMERGED):
            box.put(TextDelta(req_id="a", text=str(i % 10), token_ids=[i], num_output_tokens=i + 1))
            assert len(box._pending[0]) <= MAX_UNMERGED
        box.put(TextDelta(req_id="a", finish_reason="error", error="lost", error_code=503))
        (delta,) = (await box.get()).values()
        assert delta.text == "".join(str(i % 10) for i in range(3 * MAX_UNMERGED))
        assert delta.token_ids == list(range(3 * MAX_UNMERGED))
        assert (delta.error, delta.error_code, delta.finish_reason) == ("lost", 503, "error")
        assert box.done

    asyncio.run(main())


def _merge_reference(deltas: list[TextDelta]) -> TextDelta:
    """What merging means, field by field, written the obvious way."""
    if len(deltas) == 1:
        return deltas[0]
    logprobs = [d.logprobs for d in deltas if d.logprobs is not None]
    errors = [d for d in deltas if d.error]
    return TextDelta(
        req_id=deltas[0].req_id,
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=[lp for lps in logprobs for lp in lps] if logprobs else None,
        prompt_text=next((d.prompt_text for d in deltas if d.prompt_text is not None), None),
        prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
        finish_reason=next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None),
        stop_reason=next((d.stop_reason for d in reversed(deltas) if d.stop_reason is not None), None),
        num_prompt_tokens=max(d.num_prompt_tokens for d in deltas),
        num_output_tokens=max(d.num_output_tokens for d in deltas),
        num_cached_tokens=max(d.num_cached_tokens for d in deltas),
        error=errors[-1].error if errors else None,
        error_code=errors[-1].error_code if errors else deltas[0].error_code,
        error_param=errors[-1].error_param if errors else deltas[0].error_param,
        queue_time_s=next((d.queue_time_s for d in deltas if d.queue_time_s is not None), None),
    )


def test_merging_random_deltas_agrees_with_the_reference():
    rng = random.Random(13)

    def maybe(value, p=0.2):
        return value if rng.random() < p else None

    for _ in range(2000):
        deltas = [
            TextDelta(req_id="a", text=rng.choice(["", "x", "é", "数"]), token_ids=[rng.randrange(9)] * rng.randrange(3),
                      logprobs=maybe([_lp(rng.randrange(9))]), prompt_text=maybe(rng.choice(["", "P", "Q"])),
                      prompt_logprobs=maybe([_lp(7)]), finish_reason=maybe(rng.choice(["", "stop", "length"])),
                      stop_reason=maybe(rng.choice(["", "END", 7])), num_prompt_tokens=rng.randrange(4),
                      num_output_tokens=rng.randrange(9), num_cached_tokens=rng.randrange(3),
                      error=maybe(rng.choice(["", "lost", "gone"])), error_code=rng.choice([400, 503]),
                      error_param=maybe("prompt"), queue_time_s=maybe(rng.random()))
            for _ in range(rng.randrange(1, 5))
        ]
        assert merge_all(deltas) == _merge_reference(deltas), deltas

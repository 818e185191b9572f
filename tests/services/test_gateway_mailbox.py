"""The gateway's per-request mailbox: deltas that piled up while the reader was away come out as
one delta per choice (joined once), and a reader that stalls holds a bounded list."""

from __future__ import annotations

import asyncio

from folio.services.gateway.mailbox import MAX_UNMERGED, OutputMailbox
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

"""Images in the batching policy: the encoder budget of a step (``max_num_encoder_input_tokens``).
A chunk stops before an image whose vision tower would pass what is left of it; one image a step
always runs, so a budget smaller than an image cannot stall a prompt. An image whose placeholders
attend each other both ways (Gemma 3's, ``ImageInput.both_ways``) is never split over steps."""

from __future__ import annotations

import msgspec

from folio.shared.messages import ImageInput
from tests.core.scheduler.test_scheduler_policy import make, request, step_batch


def with_images(req, spans, both_ways: bool = False):
    images = [ImageInput(offset=o, length=n, hash=f"{i:064x}", dtype="float32", shape=[1], data=b"\0" * 4,
                         both_ways=both_ways) for i, (o, n) in enumerate(spans)]
    return msgspec.structs.replace(req, images=images)


def chunks(sched, alloc, req_id, steps):
    out = []
    for _ in range(steps):
        plan, _ = step_batch(sched, alloc)
        out.append(plan.num_scheduled_tokens.get(req_id, 0))
    return out


def test_a_chunk_stops_before_the_image_that_would_pass_the_encoder_budget():
    # two images of 10 placeholders at 5 and 20 in a 40-token prompt; 64 tokens a step, 12 for the tower
    sched, alloc = make(num_blocks=32, max_num_batched_tokens=64, max_num_encoder_input_tokens=12)
    sched.add_request(with_images(request("a", 40), [(5, 10), (20, 10)]))
    assert chunks(sched, alloc, "a", 2) == [20, 20]  # the second image waits for the next step
    # without the budget the prompt is one chunk
    sched, alloc = make(num_blocks=32, max_num_batched_tokens=64)
    sched.add_request(with_images(request("a", 40), [(5, 10), (20, 10)]))
    assert chunks(sched, alloc, "a", 1) == [40]


def test_one_image_a_step_runs_whatever_the_budget_and_requests_share_it():
    sched, alloc = make(num_blocks=64, max_num_batched_tokens=64, max_num_encoder_input_tokens=4)
    sched.add_request(with_images(request("a", 30), [(2, 10), (14, 10)]))
    sched.add_request(with_images(request("b", 12), [(1, 8)]))
    plan, _ = step_batch(sched, alloc)
    # a's first image runs (over the budget: the step's first), its second waits; b's image waits too
    assert plan.num_scheduled_tokens == {"a": 14, "b": 1}
    plan, _ = step_batch(sched, alloc)
    assert plan.num_scheduled_tokens == {"a": 16}  # a's second image takes the step's tower
    plan, _ = step_batch(sched, alloc)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 11}  # a decodes; b's image runs


def test_an_image_attended_both_ways_is_never_split_over_steps():
    # images of 10 placeholders at 5 and 20 in a 40-token prompt, 12 tokens a step: a chunk that
    # would end inside one ends before it, and the next step takes it whole
    sched, alloc = make(num_blocks=32, max_num_batched_tokens=12)
    sched.add_request(with_images(request("a", 40), [(5, 10), (20, 10)], both_ways=True))
    assert chunks(sched, alloc, "a", 5) == [5, 12, 3, 12, 8]  # [0,5) [5,17) [17,20) [20,32) [32,40)
    # the same images attended causally split where the budget says
    sched, alloc = make(num_blocks=32, max_num_batched_tokens=12)
    sched.add_request(with_images(request("a", 40), [(5, 10), (20, 10)]))
    assert chunks(sched, alloc, "a", 4) == [12, 12, 12, 4]


def test_a_chunk_inside_an_image_finishes_it_or_waits():
    """A chunk that starts inside an image attended both ways (the prefix cache held its first
    placeholders) takes it to its end or nothing; and beside a decode, a chunk before one stops there."""
    from folio.core.scheduler.policy import _whole_images

    sched, alloc = make(num_blocks=32, max_num_batched_tokens=12)
    sched.add_request(with_images(request("a", 30), [(2, 12)], both_ways=True))
    req = sched.requests["a"]
    req.num_computed_tokens = 8  # inside the image [2, 14)
    assert [_whole_images(req, n, budget=5) for n in (3, 5)] == [0, 0]  # its rest is 6
    assert [_whole_images(req, n, budget=12) for n in (3, 5, 6, 11)] == [6, 6, 6, 11]
    sched, alloc = make(num_blocks=32, max_num_batched_tokens=12)
    sched.add_request(request("d", 4))
    assert chunks(sched, alloc, "d", 1) == [4]
    sched.add_request(with_images(request("a", 30), [(2, 12)], both_ways=True))
    plan, _ = step_batch(sched, alloc)
    assert plan.num_scheduled_tokens == {"d": 1, "a": 2}  # the image (12) does not fit beside the decode
    plan, _ = step_batch(sched, alloc)
    assert plan.num_scheduled_tokens == {"d": 1}  # still no room for it whole while d decodes


def test_a_long_prefill_threshold_below_an_image_does_not_stall_it():
    """A chunk that the threshold (8) would end inside an image attended both ways runs to the
    image's end when the step's budget holds it."""
    sched, alloc = make(num_blocks=32, max_num_batched_tokens=32, long_prefill_token_threshold=8)
    sched.add_request(with_images(request("a", 40), [(5, 12)], both_ways=True))
    assert chunks(sched, alloc, "a", 4) == [17, 8, 8, 7]  # [0,17) holds the image [5,17) whole

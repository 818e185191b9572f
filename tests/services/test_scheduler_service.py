"""The scheduler with the real kvmanager and executor over ipc:// sockets, a tiny random model,
and the tokenizer's side of the protocol played by the test."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog

from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import TokenBatch
from folio.shared.sampling import SamplingParams
from folio.shared.transport import Decoder, encode
from tests.executor.toy_driver import generate
from folio.services.in_process import back_half

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 5, [10, 11], list(range(20, 50)), [3] * 9, [60, 61, 62, 63]]
MAX_TOKENS = [8, 20, 5, 12, 9, 16]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    """What the in-process driver produces for the same prompts (a pool large enough for all)."""
    runner = ModelRunner(RuntimeConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=4,
                                       num_kv_blocks=256), tiny_model_dir)
    return generate(runner, PROMPTS, [greedy(m) for m in MAX_TOKENS])


@pytest.mark.asyncio
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("num_kv_blocks, max_num_batched_tokens, max_num_seqs", [
    (256, 2048, 256),  # everything fits: pure continuous batching
    (14, 16, 4),  # small pool, small budget, few seats: chunked prefill, queueing, preemption
])
async def test_same_greedy_tokens_as_the_in_process_driver(tiny_model_dir, reference, num_kv_blocks,
                                                           max_num_batched_tokens, max_num_seqs, async_scheduling):
    async with back_half(tiny_model_dir, num_kv_blocks=num_kv_blocks, block_size=4, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling) as bh:
        outputs = await bh.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS])
        assert outputs == reference
        stats = (await bh.admin("scheduler", "stats")).data
        executor = (await bh.admin("executor", "stats")).data
        # async: plans were sent while a step ran, and reached the executor before that step ended
        assert stats["async_scheduling"] == async_scheduling
        assert (stats["num_steps_planned_ahead"] > 0) == async_scheduling
        assert (executor["num_steps_queued"] > 0) == async_scheduling
        assert (executor["num_placeholder_tokens"] > 0) == async_scheduling
        assert stats["num_prompt_tokens_total"] == sum(map(len, PROMPTS))
        assert stats["num_generation_tokens_total"] >= sum(MAX_TOKENS)
        assert stats["num_running"] == stats["num_waiting"] == 0
        if num_kv_blocks == 14:
            assert stats["num_preemptions"] > 0
        # requests came and went while others ran: many steps had more than one request
        assert max(len(b) for b in bh.batches) > 1
        for _ in range(100):  # the last step's frees reach the kvmanager in the scheduler's next call
            kv = (await bh.admin("kvmanager", "stats")).data
            if kv["num_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        assert kv["num_blocks_used"] == 0 and kv["num_blocks_total"] == num_kv_blocks


@pytest.mark.asyncio
async def test_abort_frees_blocks_and_refusals_say_why(tiny_model_dir):
    async with back_half(tiny_model_dir, num_kv_blocks=12, block_size=4, max_model_len=64) as bh:
        bh.pace(0.05)  # "long" must still be running when it is aborted
        await bh.submit("long", [1, 2, 3], greedy(40))
        await bh.submit("huge", [1] * 30, greedy(30))  # 59 tokens of KV > 12 blocks * 4
        await bh.submit("ctx", [1] * 40, greedy(30))  # 70 > max_model_len 64
        refused = await bh.collect(["huge", "ctx"])
        assert refused == {"huge": ([], "error"), "ctx": ([], "error")}
        errors = {d.req_id: d.error for b in bh.batches for d in b.all_deltas() if d.finish_reason == "error"}
        assert "KV blocks" in errors["huge"] and "maximum context length is 64" in errors["ctx"]

        deadline = time.monotonic() + 30
        while (await bh.admin("kvmanager", "stats")).data["num_blocks_used"] < 2:
            assert time.monotonic() < deadline, "the long request never held two blocks"
            await asyncio.sleep(0.01)
        assert "long" not in {d.req_id for b in bh.batches for d in b.all_deltas() if d.finish_reason}
        reply = await bh.admin("scheduler", "abort", req_id="long")
        assert reply.ok and reply.data["aborted"]
        assert (await bh.collect(["long"]))["long"][1] == "abort"
        for _ in range(100):
            if (await bh.admin("kvmanager", "stats")).data["num_blocks_used"] == 0:
                break
            await asyncio.sleep(0.01)
        assert (await bh.admin("kvmanager", "stats")).data["num_blocks_used"] == 0
        stats = (await bh.admin("scheduler", "stats")).data
        assert stats["num_requests_aborted"] == 1 and stats["num_requests_rejected"] == 2


@pytest.mark.asyncio
async def test_survives_malformed_messages(tiny_model_dir):
    with structlog.testing.capture_logs() as logs:
        await _survive_malformed(tiny_model_dir)
    dropped = [e for e in logs if e["event"] == "malformed message dropped"]
    assert len(dropped) == 4 and {e.get("req_id") for e in dropped} == {None, "bad-1"}


async def _survive_malformed(tiny_model_dir):
    async with back_half(tiny_model_dir, num_kv_blocks=32, block_size=4) as bh:
        await bh.to_scheduler.send(b"\x00\xffnot msgpack")
        await bh.to_scheduler.send(encode({"type": "engine_request", "req_id": 5}))
        await bh.to_scheduler.send(encode({"type": "engine_request", "req_id": "bad-1", "prompt_token_ids": "x"}))
        await bh.to_scheduler.send(encode({"type": "no_such_type"}))
        await bh.admin("scheduler", "stats")  # the admin socket still answers
        reply = await bh.admin("scheduler", "no-such-verb")
        assert not reply.ok
        out = await bh.generate([[1, 2, 3]], greedy(3))
        assert len(out[0]) == 3
        requests = (await bh.admin("scheduler", "requests")).data["requests"]
        assert requests == []


LONG_PROMPT, LONG_MAX_TOKENS = [5, 6, 7], 120  # still running when the executor goes away


@pytest.mark.asyncio
async def test_a_restarted_executor_makes_running_requests_start_over(tiny_model_dir, reference):
    runner = ModelRunner(RuntimeConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=4,
                                       num_kv_blocks=64), tiny_model_dir)
    long_reference = generate(runner, [LONG_PROMPT], greedy(LONG_MAX_TOKENS))[0]
    async with back_half(tiny_model_dir, num_kv_blocks=128, block_size=4) as bh:
        bh.services[2].executor.check_s = 0.3  # a lost step is noticed quickly
        req_ids = [f"req-{i}" for i in range(len(PROMPTS))] + ["req-long"]
        for req_id, prompt, m in zip(req_ids, PROMPTS + [LONG_PROMPT], MAX_TOKENS + [LONG_MAX_TOKENS]):
            await bh.submit(req_id, prompt, greedy(m))
        while sum(len(d.token_ids) for b in bh.batches for d in b.all_deltas()) < 10:
            bh.batches.append(Decoder(TokenBatch).decode(await asyncio.wait_for(bh.from_scheduler.recv(), 30)))
        before = {r: [t for b in bh.batches for d in b.all_deltas() if d.req_id == r for t in d.token_ids] for r in req_ids}
        assert len(before["req-long"]) < LONG_MAX_TOKENS  # it is mid-generation now
        await bh.restart_executor()
        after = await bh.collect(req_ids)
        assert [before[r] + after[r][0] for r in req_ids] == reference + [long_reference]
        stats = (await bh.admin("scheduler", "stats")).data
        assert stats["num_executor_restarts"] == 1
        for _ in range(100):  # the last step's frees reach the kvmanager in the scheduler's next call
            if (await bh.admin("kvmanager", "stats")).data["num_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (await bh.admin("kvmanager", "stats")).data["num_blocks_used"] == 0


async def _run_with_a_mid_run_event(tiny_model_dir, reference, event) -> tuple[dict, dict]:
    """Run every prompt (and a long one); after 10 tokens, ``event(bh)``; returns the outputs'
    check and the final scheduler and kvmanager stats."""
    runner = ModelRunner(RuntimeConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=4,
                                       num_kv_blocks=64), tiny_model_dir)
    long_reference = generate(runner, [LONG_PROMPT], greedy(LONG_MAX_TOKENS))[0]
    async with back_half(tiny_model_dir, num_kv_blocks=128, block_size=4) as bh:
        bh.pace(0.02)  # the event lands while steps still need the kvmanager, on a machine of any speed
        req_ids = [f"req-{i}" for i in range(len(PROMPTS))] + ["req-long"]
        for req_id, prompt, m in zip(req_ids, PROMPTS + [LONG_PROMPT], MAX_TOKENS + [LONG_MAX_TOKENS]):
            await bh.submit(req_id, prompt, greedy(m))
        while sum(len(d.token_ids) for b in bh.batches for d in b.all_deltas()) < 10:
            bh.batches.append(Decoder(TokenBatch).decode(await asyncio.wait_for(bh.from_scheduler.recv(), 30)))
        before = {r: [t for b in bh.batches for d in b.all_deltas() if d.req_id == r for t in d.token_ids] for r in req_ids}
        assert len(before["req-long"]) < LONG_MAX_TOKENS  # it is mid-generation now
        await event(bh)
        after = await bh.collect(req_ids)
        assert [before[r] + after[r][0] for r in req_ids] == reference + [long_reference]
        # settled: the last step's frees reach the kvmanager in the scheduler's next log, and a
        # restarted kvmanager's "out of sync" reply reaches the scheduler off the critical path,
        # possibly after the last token (then the new epoch follows); both hold the same epoch
        for _ in range(600):
            stats = (await bh.admin("scheduler", "stats")).data
            kv = (await bh.admin("kvmanager", "stats")).data
            if kv["num_blocks_used"] == 0 and kv.get("generation") == stats["generation"]:
                break
            await asyncio.sleep(0.05)
        return stats, kv


@pytest.mark.asyncio
async def test_a_kvmanager_killed_under_load_costs_a_new_epoch_and_loses_nothing(tiny_model_dir, reference):
    stats, kv = await _run_with_a_mid_run_event(tiny_model_dir, reference, lambda bh: bh.restart_kvmanager())
    assert stats["num_epochs"] == 2 and stats["num_executor_restarts"] == 0  # the start, then the restart
    assert kv["num_blocks_used"] == 0 and kv["generation"] == stats["generation"] and kv["num_refused_ops"] == 0


@pytest.mark.asyncio
async def test_stats_show_an_epoch_only_once_both_sides_hold_it(tiny_model_dir):
    """The scheduler's ``generation`` moves with ``num_epochs``, never while its reset is in flight:
    the kvmanager already holds the new generation then, and a reader comparing the two would take
    the new epoch for settled before the scheduler counted it."""
    async with back_half(tiny_model_dir, num_kv_blocks=64, block_size=4) as bh:
        await bh.generate([[1, 2, 3]], greedy(3))
        link, call = bh.services[2].kvmanager, bh.services[2].kvmanager.call

        async def slow_call(request, timeout_s=None):  # the kvmanager's answer is late to arrive
            info = await call(request, timeout_s)
            await asyncio.sleep(0.5)
            return info

        link.call = slow_call
        await bh.restart_kvmanager()
        await bh.submit("after", [4, 5, 6], greedy(3))  # its step finds the kvmanager out of sync
        seen = set()
        for _ in range(60):
            stats = (await bh.admin("scheduler", "stats")).data
            kv = (await bh.admin("kvmanager", "stats")).data
            assert stats["generation"] == stats["num_epochs"]
            seen.add((stats["generation"], kv.get("generation")))
            if stats["generation"] == 2:
                break
            await asyncio.sleep(0.05)
        assert (1, 2) in seen and stats["generation"] == 2  # the window was seen, then closed
        assert len((await bh.collect(["after"]))["after"][0]) == 3


@pytest.mark.asyncio
async def test_a_diverged_kvmanager_is_caught_by_the_digest(tiny_model_dir, reference):
    async def diverge(bh):
        bh.services[0].allocator.device.take(1)  # a block the replica knows nothing of

    stats, kv = await _run_with_a_mid_run_event(tiny_model_dir, reference, diverge)
    assert stats["num_digest_mismatches"] == 1 and stats["num_epochs"] == 2
    assert kv["num_blocks_used"] == 0 and kv["generation"] == stats["generation"]

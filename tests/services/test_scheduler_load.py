"""The scheduler service under load and under control, with the real kvmanager and executor over
ipc:// sockets and a tiny random model: 200 concurrent requests on a 64-block pool, drain and
resume, admin abort."""

from __future__ import annotations

import asyncio
import random

import pytest

from folio.shared.sampling import SamplingParams
from folio.services.in_process import back_half
from tests.core.engine import alone, engine_request, make_runner

NUM_REQUESTS = 200


def workload(seed: int = 7):
    """200 requests: prompts of 3..60 tokens, outputs of 4..40; half greedy, half seeded sampling.
    Each needs at most 7 blocks of 16; all together need about ten times the 64 blocks."""
    rng = random.Random(seed)
    reqs = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(1, 128) for _ in range(rng.randint(3, 60))]
        sampling = {} if i % 2 else dict(temperature=0.8, top_k=20, seed=i)
        reqs.append(engine_request(f"q{i}", prompt, rng.randint(4, 40), ignore_eos=True, **sampling))
    return reqs


@pytest.fixture(scope="module")
def solo(tiny_model_dir):
    """Every request run alone, with a pool that holds it whole."""
    runner = make_runner(tiny_model_dir, num_kv_blocks=64)
    return {m.req_id: alone(runner, m).token_ids for m in workload()}


async def wait_for_kv_idle(bh, timeout_s: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = (await bh.admin("kvmanager", "stats")).data
        if stats["num_blocks_used"] == 0 or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def wait_until_running(bh, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await bh.admin("scheduler", "stats")).data["num_running"] == 0:
        assert asyncio.get_running_loop().time() < deadline, "no request started running"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_200_concurrent_requests_on_64_blocks_all_finish_as_if_alone(tiny_model_dir, solo, mode):
    async with back_half(tiny_model_dir, num_kv_blocks=64, block_size=16, max_num_seqs=256,
                         max_num_batched_tokens=512, num_host_blocks=128, preemption_mode=mode) as bh:
        reqs = workload()
        for m in reqs:
            await bh.submit(m.req_id, m.prompt_token_ids, m.sampling)
        outputs = await bh.collect([m.req_id for m in reqs], timeout_s=120)
        assert {r: tokens for r, (tokens, _) in outputs.items()} == solo
        assert {reason for _, reason in outputs.values()} == {"length"}
        stats = (await bh.admin("scheduler", "stats")).data
        assert stats["num_preemptions"] > 0 and stats["max_num_running"] > 1
        assert (stats["num_swap_outs"] > 0) == (mode == "swap")
        kv = await wait_for_kv_idle(bh)
        assert kv["num_blocks_used"] == 0 and kv["num_host_blocks_used"] == 0 and kv["num_seqs"] == 0


@pytest.mark.asyncio
async def test_drain_finishes_accepted_work_and_refuses_new_requests(tiny_model_dir):
    async with back_half(tiny_model_dir, num_kv_blocks=64, block_size=16) as bh:
        bh.pace(0.05)  # "before" must still be running when the drain comes
        await bh.submit("before", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        await wait_until_running(bh)
        drained = await bh.admin("scheduler", "drain")
        assert drained.ok and drained.data["draining"] and not drained.data["idle"]
        await bh.submit("during", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=4))
        outputs = await bh.collect(["before", "during"])
        assert outputs["during"] == ([], "error") and len(outputs["before"][0]) == 40
        refusal = next(d for b in bh.batches for d in b.all_deltas() if d.req_id == "during")
        assert refusal.error_code == 503 and "draining" in refusal.error
        assert (await bh.admin("scheduler", "stats")).data["draining"] is True
        assert (await bh.admin("scheduler", "resume")).data == {"draining": False}
        await bh.submit("after", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=4))
        assert (await bh.collect(["after"]))["after"][1] == "length"


@pytest.mark.asyncio
async def test_admin_abort_ends_the_stream_and_frees_blocks_unknown_ids_are_an_error(tiny_model_dir):
    async with back_half(tiny_model_dir, num_kv_blocks=64, block_size=16) as bh:
        bh.pace(0.02)  # "long" must still be running when it is aborted
        await bh.submit("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        await wait_until_running(bh)
        reply = await bh.admin("scheduler", "abort", req_id="long")
        assert reply.ok and reply.data["aborted"]
        tokens, reason = (await bh.collect(["long"]))["long"]
        assert reason == "abort" and len(tokens) < 200
        assert (await wait_for_kv_idle(bh))["num_blocks_used"] == 0
        missing = await bh.admin("scheduler", "abort", req_id="long")
        assert not missing.ok and "no request 'long'" in missing.error

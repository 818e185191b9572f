"""A step plan the executor refuses, end to end through the real back half (kvmanager, executor and
scheduler over ipc:// sockets, a tiny random model): a request whose prompt holds a token outside
the model's vocabulary (as a tokenizer that skipped its check would send it) makes the scheduler
plan a step the executor cannot run. The executor refuses it before any kernel runs, logs why
once and answers; the scheduler ends that step's requests with the reason; every other request,
and every request after, gets the tokens it gets without the refusal, and no block is lost."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.services.in_process import back_half
from tests.executor.toy_driver import generate

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 5, [10, 11], list(range(20, 50))]
MAX_TOKENS = [8, 20, 5, 12]
POISON = [1, 2, 500, 3]  # the tiny model's vocabulary is 0..127
REFUSAL = "token id 500 is outside the vocabulary (0..127)"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    runner = ModelRunner(RuntimeConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=4,
                                       num_kv_blocks=256), tiny_model_dir)
    return generate(runner, PROMPTS, [greedy(m) for m in MAX_TOKENS])


def errors(bh) -> dict[str, str]:
    return {d.req_id: d.error for b in bh.batches for d in b.all_deltas() if d.finish_reason == "error"}


async def no_block_held(bh) -> None:
    for _ in range(200):  # the last frees reach the kvmanager with the scheduler's next call
        if (await bh.admin("kvmanager", "stats")).data["num_blocks_used"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("blocks of the refused step's requests were never freed")


@pytest.mark.asyncio
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
async def test_a_refused_step_ends_its_requests_and_the_rest_is_served(tiny_model_dir, reference, async_scheduling):
    with structlog.testing.capture_logs() as logs:
        async with back_half(tiny_model_dir, num_kv_blocks=64, block_size=4, async_scheduling=async_scheduling) as bh:
            await bh.submit("poison", POISON, greedy(4))
            assert await bh.collect(["poison"]) == {"poison": ([], "error")}
            assert REFUSAL in errors(bh)["poison"]
            assert await bh.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]) == reference

            # among running requests: those that shared the refused step end with its reason, the
            # others finish as they would have
            bh.pace(0.02)
            for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):
                await bh.submit(f"run-{i}", prompt, greedy(max_tokens))
            await asyncio.sleep(0.1)
            await bh.submit("poison-2", POISON, greedy(4))
            out = await bh.collect([f"run-{i}" for i in range(len(PROMPTS))] + ["poison-2"])
            assert out["poison-2"] == ([], "error") and REFUSAL in errors(bh)["poison-2"]
            for i, want in enumerate(reference):
                tokens, reason = out[f"run-{i}"]
                assert tokens == want[:len(tokens)]
                assert reason == "length" and tokens == want or reason == "error" and REFUSAL in errors(bh)[f"run-{i}"]
            await no_block_held(bh)

            assert await bh.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]) == reference
            # the executor holds none of the refused steps' requests (the last requests' end
            # reaches it with the next plan)
            assert set(bh.runner.requests) <= {f"req-{i}" for i in range(len(PROMPTS))}
            scheduler = (await bh.admin("scheduler", "stats")).data
            assert scheduler["num_running"] == scheduler["num_waiting"] == 0
    refusals = [e for e in logs if e["event"] == "step plan refused"]
    assert len(refusals) >= 2 and all(REFUSAL in e["error"] for e in refusals)
    assert not [e for e in logs if e["event"] == "step failed"]  # no traceback: a refusal is not a crash

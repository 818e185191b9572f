"""The step loop (``folio.core.scheduler.step_loop``) in one process: run inline over the model
runner, it plans step N+1 before step N runs when async scheduling is on, and never otherwise."""

from __future__ import annotations

import asyncio

import pytest

from folio.core.engine import run_inline
from tests.core.engine import LocalEngine, engine_request, make_runner


async def answer(value):
    return value


async def wait_once():
    await asyncio.sleep(0)


def test_run_inline_gives_a_coroutines_value_and_refuses_one_that_waits():
    assert run_inline(answer(7)) == 7
    with pytest.raises(RuntimeError, match="waited"):
        run_inline(wait_once())


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_next_step_is_sent_before_the_last_one_runs_only_with_async_scheduling(tiny_model_dir, async_scheduling):
    engine = LocalEngine(make_runner(tiny_model_dir, num_kv_blocks=64), async_scheduling=async_scheduling)
    events = []
    executor = engine.executor
    send_plan, receive_result = executor.send_plan, executor.receive_result

    async def sending(plan):
        events.append(("send", plan.step_id))
        await send_plan(plan)

    async def running(step_id):
        events.append(("run", step_id))
        return await receive_result(step_id)

    executor.send_plan, executor.receive_result = sending, running
    for i in range(3):
        engine.add(engine_request(f"r{i}", [5 + i, 6, 7, 8], max_tokens=6, ignore_eos=True))
    outputs = engine.run()
    assert all(len(o.token_ids) == 6 for o in outputs.values())
    sends = [step for kind, step in events if kind == "send"]
    runs = [step for kind, step in events if kind == "run"]
    assert sends == runs == list(range(len(runs)))  # every step sent once, run once, in order
    ahead = [events.index(("send", k + 1)) < events.index(("run", k)) for k in range(len(runs) - 1)]
    assert any(ahead) == async_scheduling
    assert engine.sched.counters["num_steps_planned_ahead"] == sum(ahead)

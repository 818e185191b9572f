"""The executor service: StepPlans over its ROUTER give what the runner gives in-process; it
registers its pool with the kvmanager at start; malformed messages are dropped."""

from __future__ import annotations

import asyncio
import shutil

import msgspec
import pytest
import zmq
import zmq.asyncio

from folio.core.executor.runtime.runner import ModelRunner
from folio.services.executor.service import ExecutorService
from folio.services.kvmanager.service import KVManagerService
from folio.shared.config import Endpoints, ExecutorServiceConfig, KVManagerConfig, RuntimeConfig
from folio.shared.messages import NewRequestData, RunningRequestData, StepPlan, StepResult
from folio.shared.sampling import SamplingParams
from folio.shared.transport import Decoder, encode, make_socket
from folio.services.in_process import admin_call, short_run_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def plans() -> list[StepPlan]:
    new = NewRequestData(req_id="r", token_ids=[1, 2, 3, 4, 5], num_prompt_tokens=5, sampling=GREEDY,
                         block_ids=[3, 1])
    return [
        StepPlan(step_id=0, new_reqs=[new], num_scheduled_tokens={"r": 5}),
        StepPlan(step_id=1, running_reqs=[RunningRequestData(req_id="r", new_block_ids=[], num_computed_tokens=5)],
                 num_scheduled_tokens={"r": 1}),
        StepPlan(step_id=2, running_reqs=[RunningRequestData(req_id="r", new_block_ids=[], num_computed_tokens=6)],
                 num_scheduled_tokens={"r": 1}),
    ]


@pytest.mark.asyncio
async def test_steps_over_the_socket_match_the_runner_and_the_pool_is_registered(tiny_model_dir):
    runtime = RuntimeConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=4, num_kv_blocks=8)
    local = ModelRunner(runtime, tiny_model_dir)
    expected = [local.execute(p) for p in plans()]

    run_dir = short_run_dir()
    ep = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    kv = KVManagerService(KVManagerConfig(endpoints=ep), ctx)
    executor = ExecutorService(ExecutorServiceConfig(endpoints=ep, runtime=runtime, model_path=tiny_model_dir), ctx)
    tasks = [asyncio.ensure_future(kv.run()), asyncio.ensure_future(executor.run())]
    scheduler = make_socket(ctx, zmq.DEALER, ep.executor)
    try:
        await scheduler.send(b"\xc1 garbage")  # malformed: dropped, logged
        await scheduler.send(encode({"type": "step_plan", "step_id": "x"}))
        decoder = Decoder(StepResult)
        got = []
        for plan in plans():
            await scheduler.send(encode(plan))
            got.append(decoder.decode(await asyncio.wait_for(scheduler.recv(), 30)))
        assert got == [msgspec.structs.replace(r, epoch=executor.epoch) for r in expected]
        assert [r.token_ids for r in got][0] != []

        # a plan that names an unknown request is answered (empty), not left hanging
        bad = StepPlan(step_id=9, running_reqs=[RunningRequestData(req_id="ghost", new_block_ids=[],
                                                                   num_computed_tokens=0)],
                       num_scheduled_tokens={"ghost": 1})
        await scheduler.send(encode(bad))
        refused = decoder.decode(await asyncio.wait_for(scheduler.recv(), 30))
        assert refused.step_id == 9 and refused.token_ids == [] and "unknown request 'ghost'" in refused.error
        # a block outside the pool: refused before any kernel runs, and the next plan is served as
        # though the refused ones never came
        outside = StepPlan(step_id=10, new_reqs=[NewRequestData(req_id="s", token_ids=[1, 2], num_prompt_tokens=2,
                                                                sampling=GREEDY, block_ids=[8])],
                           num_scheduled_tokens={"s": 2})
        await scheduler.send(encode(outside))
        refused = decoder.decode(await asyncio.wait_for(scheduler.recv(), 30))
        assert refused.token_ids == [] and "s: block id 8 is outside the pool (0..7)" in refused.error
        after = StepPlan(step_id=11, running_reqs=[RunningRequestData(req_id="r", new_block_ids=[], num_computed_tokens=7)],
                         num_scheduled_tokens={"r": 1})
        await scheduler.send(encode(after))
        assert decoder.decode(await asyncio.wait_for(scheduler.recv(), 30)) == \
            msgspec.structs.replace(local.execute(after), epoch=executor.epoch)

        kv_stats = (await admin_call(ctx, ep.admin_kvmanager, "stats")).data
        assert kv_stats["registered"] and kv_stats["num_blocks_total"] == 8 and kv_stats["epoch"] == executor.epoch
        assert kv_stats["bytes_per_block"] == local.pool_shape.bytes_per_block
        ex_stats = (await admin_call(ctx, ep.admin_executor, "stats")).data
        assert ex_stats["num_blocks"] == 8 and ex_stats["block_size"] == 4 and ex_stats["num_steps"] == 6
    finally:
        scheduler.close(linger=0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_the_runner_is_loaded_on_the_thread_that_runs_the_steps(tiny_model_dir, monkeypatch):
    """All torch work on one thread: a model loaded on another thread leaves a second OpenMP team
    behind on the CPU, and libgomp then has both teams' workers sleep between parallel regions
    (SmolLM2's decode step at batch 64 took twice as long)."""
    import threading

    import folio.services.executor.service as service_module

    loaded_on = []

    def recording_make_runner(config):
        loaded_on.append(threading.get_ident())
        return service_module.make_runner.__wrapped__(config)

    recording_make_runner.__wrapped__ = service_module.make_runner
    monkeypatch.setattr(service_module, "make_runner", recording_make_runner)
    runtime = RuntimeConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=4, num_kv_blocks=8)
    ctx = zmq.asyncio.Context()
    run_dir = short_run_dir()
    executor = None
    try:
        executor = ExecutorService(ExecutorServiceConfig(endpoints=Endpoints.ipc(run_dir), runtime=runtime,
                                                         model_path=tiny_model_dir), ctx)
        step_thread = executor.step_thread.submit(threading.get_ident).result()
        assert loaded_on == [step_thread] and step_thread != threading.get_ident()
    finally:
        if executor is not None:
            executor.step_thread.shutdown()
            for sock in (executor.recv_from_scheduler, executor.send_to_kvmanager, executor.recv_from_admin):
                sock.close(linger=0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)

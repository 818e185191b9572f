"""``--distributed-executor-backend ray``: rank 1 as a Ray actor in a placement group, on a local
Ray cluster this test starts; the same tokens as one rank, per-rank stats through the group, and a
killed actor is an executor crash (``on_failure``, then ``WorkerGroupError``). One test: a Ray
cluster takes seconds to start."""

from __future__ import annotations

import time

import pytest
import ray

from folio.core.executor.runtime.runner import ModelRunner
from folio.core.executor.runtime.workers import ParallelRunner, WorkerGroupError
from folio.testing.models import write_tiny_model
from tests.executor.test_tensor_parallel import PROMPTS, config, outputs, requests
from tests.core.engine import LocalEngine, engine_request

pytestmark = pytest.mark.slow  # Ray's start alone takes seconds


def test_ray_workers_match_one_rank_and_a_dead_actor_is_a_crash(tmp_path):
    model = write_tiny_model(tmp_path / "m", model_type="qwen2", num_key_value_heads=1, vocab_size=129)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    failures: list[str] = []
    runner = None
    try:
        runner = ParallelRunner(config(model, 2, distributed_executor_backend="ray"), model,
                                on_failure=failures.append)
        reqs = requests()
        assert outputs(runner, reqs) == outputs(ModelRunner(config(model), model), reqs)
        reports = runner.rank_reports()
        assert [r["rank"] for r in reports] == [0, 1] and all(r["num_steps"] > 0 for r in reports)
        assert not failures

        ray.kill(runner.workers.actors[0])
        deadline = time.monotonic() + 60
        while not failures and time.monotonic() < deadline:
            time.sleep(0.1)
        assert failures and "rank 1" in failures[0]
        engine = LocalEngine(runner)
        engine.add(engine_request("after", PROMPTS[1], 2))
        out = engine.sched.schedule()
        engine.alloc.apply(out)
        with pytest.raises(WorkerGroupError):
            runner.execute(engine.sched.build_plan(out))
    finally:
        if runner is not None:
            runner.close(timeout_s=5)
        ray.shutdown()

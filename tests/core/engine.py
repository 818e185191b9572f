"""The engine in one process (``folio.core.engine.EngineCore``: the scheduler's policy, its allocator
replica and the executor's runner, stepped as the services step them), with an allocator of record
fed each step's log as the kvmanager is (``kv_owner.Owner``), and every step's plan and log kept,
so that tests can look at every step and at the allocator of record between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from folio.core.engine import EngineCore
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import EngineRequest, StepPlan, TokenDelta
from folio.shared.sampling import SamplingParams
from tests.core.kv_owner import Owner


@dataclass
class Output:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class LocalEngine(EngineCore):
    def __init__(self, runner: ModelRunner, max_num_seqs: int = 256, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, **options):
        super().__init__(runner, max_num_seqs, max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                         **options)
        pool = runner.pool
        self.sched = self.scheduler
        self.alloc = Owner(pool.num_blocks, pool.block_size, pool.num_host_blocks,
                           enable_prefix_caching=enable_prefix_caching)
        self.outputs: dict[str, Output] = {}
        self.plans: list[StepPlan] = []
        self.logs: list[list] = []  # each step's allocator log

    def add(self, msg: EngineRequest) -> None:
        for req_id in (msg.req_id, *msg.fork_req_ids):
            self.outputs[req_id] = Output()
        self._record(self.add_request(msg))

    def on_plan(self, out, plan: StepPlan) -> None:
        self.alloc.apply(out)
        self.logs.append(out.ops)
        self.plans.append(plan)

    def step(self) -> bool:
        batch = super().step()
        if batch is None:
            return False
        self._record(batch.all_deltas())
        return True

    def run(self, max_steps: int = 100_000) -> dict[str, Output]:
        for _ in range(max_steps):
            if not self.has_work() or not self.step():
                break
        return self.outputs

    def _record(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            out = self.outputs[d.req_id]
            out.token_ids.extend(d.token_ids)
            if d.finish_reason is not None:
                out.finish_reason, out.error = d.finish_reason, d.error


def make_runner(model_dir: str, num_kv_blocks: int, block_size: int = 16, num_host_blocks: int = 0,
                max_num_batched_tokens: int = 512) -> ModelRunner:
    config = RuntimeConfig(num_kv_blocks=num_kv_blocks, block_size=block_size, num_host_blocks=num_host_blocks,
                           max_num_batched_tokens=max_num_batched_tokens, device="cpu", dtype="float32",
                           quantization="none")  # SmolLM2 oracles compare with transformers in fp32
    return ModelRunner(config, model_dir)


def engine_request(req_id: str, prompt: list[int], max_tokens: int, eos_token_id: int | None = None,
                   **options) -> EngineRequest:
    """``options``: SamplingParams fields, plus ``fork_req_ids``, ``priority`` and ``grammar``."""
    extra = {k: options.pop(k) for k in ("fork_req_ids", "priority", "grammar") if k in options}
    options.setdefault("temperature", 0.0)
    return EngineRequest(req_id=req_id, prompt_token_ids=list(prompt), eos_token_id=eos_token_id,
                         sampling=SamplingParams(max_tokens=max_tokens, **options), **extra)


def alone(runner: ModelRunner, msg: EngineRequest) -> Output:
    """``msg`` run by itself (choice i of a request with choices: ``with_seed_offset(i)``)."""
    engine = LocalEngine(runner)
    engine.add(msgspec.structs.replace(msg, fork_req_ids=[]))
    return engine.run()[msg.req_id]

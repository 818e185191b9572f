"""The back half of the services (kvmanager, executor, scheduler) run in the caller's process: real
services on real ``ipc://`` sockets as asyncio tasks in its loop, and the tokenizer's two sockets
(PUSH ``EngineRequest``s, PULL ``TokenBatch``es) in its hands. For tests and benchmarks."""

from __future__ import annotations

import asyncio
import shutil
import time
import tempfile
from contextlib import asynccontextmanager

import zmq
import zmq.asyncio

from folio.core.executor.runtime.runner import ModelRunner
from folio.services.executor.service import ExecutorService
from folio.services.kvmanager.service import KVManagerService
from folio.services.scheduler.service import SchedulerService
from folio.shared.config import Endpoints, ExecutorServiceConfig, KVManagerConfig, RuntimeConfig, SchedulerConfig
from folio.shared.transport import QUIET, ask_admin
from folio.shared.messages import AdminReply, EngineRequest, TokenBatch
from folio.shared.sampling import SamplingParams
from folio.shared.transport import Decoder, encode, make_socket


def short_run_dir() -> str:
    """ipc:// paths must stay under ~100 bytes: pytest's tmp_path can be longer."""
    return tempfile.mkdtemp(prefix="folio-t-", dir="/tmp")


async def admin_call(ctx: zmq.asyncio.Context, address: str, command: str, timeout_s: float = 5.0, **args) -> AdminReply:
    reply = await ask_admin(ctx, address, command, args, timeout_s, QUIET)
    assert reply is not None, f"{address} did not answer {command!r} within {timeout_s}s"
    return reply


class BackHalf:
    """kvmanager + executor + scheduler, and the tokenizer's two sockets."""

    def __init__(self, ctx, endpoints: Endpoints, tasks: list[asyncio.Task], runner: ModelRunner, services=()):
        self.ctx, self.endpoints, self.tasks, self.runner, self.services = ctx, endpoints, tasks, runner, services
        self.to_scheduler = make_socket(ctx, zmq.PUSH, endpoints.scheduler_in)
        self.from_scheduler = make_socket(ctx, zmq.PULL, endpoints.tokenizer_in)
        self.batches: list[TokenBatch] = []

    def pace(self, seconds: float) -> None:
        """Make every model step take at least ``seconds`` longer: a test that must act on a request
        while it still runs (abort, drain) then holds on a machine of any speed."""
        execute = self.runner.execute

        def paced(plan):
            time.sleep(seconds)
            return execute(plan)

        self.runner.execute = paced

    async def submit(self, req_id: str, prompt: list[int], params: SamplingParams, eos_token_id=None,
                     **extra) -> None:
        """``extra``: more EngineRequest fields (fork_req_ids, priority, grammar)."""
        msg = EngineRequest(req_id=req_id, prompt_token_ids=prompt, sampling=params, eos_token_id=eos_token_id,
                            **extra)
        await self.to_scheduler.send(encode(msg))

    async def collect(self, req_ids, timeout_s: float = 60.0) -> dict[str, tuple[list[int], str]]:
        """Read TokenBatches until every request in ``req_ids`` finished: its tokens and finish reason."""
        decoder = Decoder(TokenBatch)
        pending = set(req_ids)
        tokens: dict[str, list[int]] = {r: [] for r in req_ids}
        reasons: dict[str, str] = {}
        while pending:
            batch = decoder.decode(await asyncio.wait_for(self.from_scheduler.recv(), timeout_s))
            self.batches.append(batch)
            for delta in batch.all_deltas():
                if delta.req_id not in tokens:
                    continue
                tokens[delta.req_id].extend(delta.token_ids)
                if delta.finish_reason is not None:
                    reasons[delta.req_id] = delta.finish_reason
                    pending.discard(delta.req_id)
        return {r: (tokens[r], reasons[r]) for r in req_ids}

    async def generate(self, prompts: list[list[int]], params, eos_token_id=None) -> list[list[int]]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        req_ids = [f"req-{i}" for i in range(len(prompts))]
        for req_id, prompt, sp in zip(req_ids, prompts, params):
            await self.submit(req_id, prompt, sp, eos_token_id)
        out = await self.collect(req_ids)
        return [out[r][0] for r in req_ids]

    async def restart_executor(self) -> None:
        """Stop the executor and start a new one (a new epoch) on the same sockets."""
        await self._restart(1, ExecutorService)

    async def restart_kvmanager(self) -> None:
        """Stop the kvmanager and start a new, empty one on the same sockets (it knows no pool)."""
        await self._restart(0, KVManagerService)

    async def _restart(self, index: int, service_type) -> None:
        old_task, old = self.tasks[index], self.services[index]
        old_task.cancel()
        await asyncio.gather(old_task, return_exceptions=True)
        new = service_type(old.config, self.ctx)
        self.services[index], self.tasks[index] = new, asyncio.ensure_future(new.run())

    async def admin(self, service: str, command: str, **args) -> AdminReply:
        return await admin_call(self.ctx, getattr(self.endpoints, f"admin_{service}"), command, **args)


@asynccontextmanager
async def back_half(model_dir: str, *, num_kv_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                    max_num_batched_tokens: int = 64, max_model_len: int | None = None, runner: ModelRunner | None = None,
                    enable_prefix_caching: bool = True, num_host_blocks: int = 0, **scheduling):
    """``scheduling``: SchedulerConfig's options (preemption_mode, enable_chunked_prefill, ...)."""
    run_dir = short_run_dir()
    endpoints = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    runtime = RuntimeConfig(model=model_dir, dtype="float32", device="cpu", block_size=block_size,
                            num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, num_host_blocks=num_host_blocks)
    executor = ExecutorService(ExecutorServiceConfig(endpoints=endpoints, runtime=runtime, model_path=model_dir),
                               ctx, runner=runner)
    services = [
        KVManagerService(KVManagerConfig(endpoints=endpoints, enable_prefix_caching=enable_prefix_caching), ctx),
        executor,
        SchedulerService(SchedulerConfig(endpoints=endpoints, max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=max_model_len, **scheduling), ctx),
    ]
    tasks = [asyncio.ensure_future(s.run()) for s in services]
    harness = BackHalf(ctx, endpoints, tasks, executor.runner, services)
    try:
        yield harness
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        harness.to_scheduler.close(linger=0)
        harness.from_scheduler.close(linger=0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)

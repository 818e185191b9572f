"""Benchmark: what the scheduler and the kvmanager cost per step, against an executor that answers at once.

The real services run as processes (``folio run kvmanager``, ``folio run scheduler``) on ipc://
sockets. This script plays the executor (it registers a pool and answers each ``StepPlan`` at
once: one token, 7, for every request that caught up) and the tokenizer (it pushes the requests
and pulls the ``TokenBatch``es). With the executor's own time taken out, the time from sending
step N's result to receiving step N+1's plan is what the services cost on the critical path of
every step: the scheduler reading the result, updating its requests, pushing the tokens, planning
with its allocator replica, sending the step log and encoding the plan.

More in docs/modules.md (folio/bench/scheduler.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import zmq
import zmq.asyncio

from folio.bench.cpu_meter import CpuMeter
from folio.shared.config import Endpoints
from folio.shared.messages import (
    AdminReply,
    AdminRequest,
    EngineRequest,
    PoolInfo,
    RegisterPool,
    StepPlan,
    StepResult,
    TokenBatch,
)
from folio.shared.sampling import SamplingParams
from folio.shared.transport import Decoder, encode, make_socket, recv_multipart

EPOCH = "bench"


class FakeExecutor:
    """Answers every plan at once; records the gap between its answer and the next plan."""

    def __init__(self, ctx, ep: Endpoints, num_requests: int):
        self.sock = make_socket(ctx, zmq.ROUTER, ep.executor)
        self.kv = make_socket(ctx, zmq.DEALER, ep.kvmanager)
        self.num_requests = num_requests
        self.state: dict[str, list[int]] = {}  # req_id -> [num tokens, num computed]
        self.gaps: list[float] = []  # seconds from a result to the next plan, full decode steps only
        self.plan_bytes: list[int] = []
        self.num_steps = 0

    async def register(self, num_blocks: int, block_size: int) -> None:
        await self.kv.send(encode(RegisterPool(num_blocks=num_blocks, block_size=block_size, bytes_per_block=1,
                                               epoch=EPOCH, max_model_len=8192)))
        Decoder(PoolInfo).decode(await self.kv.recv())

    async def serve(self) -> None:
        decoder = Decoder(StepPlan)
        sent_at = None
        while True:
            envelope_and_data = await recv_multipart(self.sock)  # (as the executor's ROUTER loop reads)
            received_at = time.perf_counter()
            plan = decoder.decode(envelope_and_data[-1])
            counts = plan.num_scheduled_tokens
            full_decode = len(counts) == self.num_requests and sum(counts.values()) == self.num_requests
            if sent_at is not None and full_decode:
                self.gaps.append(received_at - sent_at)
                self.plan_bytes.append(len(envelope_and_data[-1]))
            result = self.execute(plan)
            await self.sock.send_multipart([*envelope_and_data[:-1], encode(result)])
            sent_at = time.perf_counter()
            self.num_steps += 1

    def execute(self, plan: StepPlan) -> StepResult:
        state = self.state
        for req_id in plan.finished_req_ids:
            state.pop(req_id, None)
        for new in plan.new_reqs:
            state[new.req_id] = [len(new.token_ids), new.num_computed_tokens]
        for running in plan.running_reqs:
            s = state[running.req_id]
            s[0] += len(running.new_token_ids)
            s[1] = running.num_computed_tokens
        samplers = []
        for req_id, n in plan.num_scheduled_tokens.items():
            s = state[req_id]
            s[1] += n
            if s[1] >= s[0]:
                samplers.append(req_id)
                s[0] += 1
        return StepResult(step_id=plan.step_id, req_ids=samplers, token_ids=[7] * len(samplers),
                          epoch=EPOCH)


async def admin(ctx, address: str, command: str) -> dict:
    sock = make_socket(ctx, zmq.DEALER, address)
    try:
        await sock.send(encode(AdminRequest(command=command)))
        return Decoder(AdminReply).decode(await asyncio.wait_for(sock.recv(), 30)).data
    finally:
        sock.close(linger=0)


async def run(args, ep: Endpoints) -> None:
    ctx = zmq.asyncio.Context()
    executor = FakeExecutor(ctx, ep, args.num_requests)
    to_scheduler = make_socket(ctx, zmq.PUSH, ep.scheduler_in)
    from_scheduler = make_socket(ctx, zmq.PULL, ep.tokenizer_in)
    num_blocks = args.num_requests * -(-(args.prompt_len + args.max_tokens) // args.block_size) + 64
    await executor.register(num_blocks, args.block_size)
    server = asyncio.ensure_future(executor.serve())
    rng = random.Random(0)
    meter = CpuMeter()
    for i in range(args.num_requests):
        prompt = [rng.randrange(1, 30000) for _ in range(args.prompt_len)]
        await to_scheduler.send(encode(EngineRequest(
            req_id=f"r{i}", prompt_token_ids=prompt, eos_token_id=0,
            sampling=SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))))
    finished, num_tokens, decoder = 0, 0, Decoder(TokenBatch)
    t0 = time.perf_counter()
    while finished < args.num_requests:
        batch = decoder.decode(await asyncio.wait_for(from_scheduler.recv(), 120))
        num_tokens += len(batch.plain_token_ids)
        for delta in batch.deltas:
            num_tokens += len(delta.token_ids)
            finished += delta.finish_reason is not None
    wall = time.perf_counter() - t0
    stats = await admin(ctx, ep.admin_scheduler, "stats")
    cpu = meter.lap()
    server.cancel()
    gaps = sorted(executor.gaps)
    steps = max(1, stats["num_steps"])
    print(f"{args.num_requests} requests, prompts of {args.prompt_len} tokens, {args.max_tokens} tokens each, "
          f"block size {args.block_size}: {executor.num_steps} steps, {num_tokens} tokens in {wall:.1f} s")
    print(f"critical path per step at {args.num_requests} running decodes ({len(gaps)} steps): "
          f"median {1e3 * statistics.median(gaps):.3f} ms, p90 {1e3 * gaps[int(0.9 * len(gaps))]:.3f} ms, "
          f"mean {1e3 * statistics.fmean(gaps):.3f} ms")
    print(f"scheduler, per step (all steps): planning {1e3 * stats['plan_seconds_total'] / steps:.3f} ms, "
          f"update and push {1e3 * stats['update_seconds_total'] / steps:.3f} ms; "
          f"plan on the wire: {statistics.median(executor.plan_bytes):.0f} bytes")
    print(f"CPU: {cpu}")
    ctx.destroy(linger=0)


def in_process(args) -> None:
    from folio.core.scheduler.policy import Scheduler

    sched = Scheduler(args.num_requests, 8192)
    sched.set_pool(PoolInfo(num_blocks=args.num_requests * 64, block_size=args.block_size, bytes_per_block=1,
                            epoch=EPOCH, max_model_len=8192))
    rng = random.Random(0)
    for i in range(args.num_requests):
        sched.add_request(EngineRequest(
            req_id=f"r{i}", prompt_token_ids=[rng.randrange(1, 30000) for _ in range(args.prompt_len)], eos_token_id=0,
            sampling=SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)))
    decoder, plan_decoder = Decoder(StepResult), Decoder(StepPlan)
    parts = dict.fromkeys(("schedule", "build plan", "encode plan", "decode plan (executor)", "result", "update",
                           "encode tokens"), 0.0)
    sizes = dict.fromkeys(("plan", "step log", "result", "tokens"), 0)

    def step() -> None:
        clock = time.perf_counter
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        log = encode(sched.kv_request(out, 1)) if out.ops else b""
        plan = sched.build_plan(out)
        t2 = clock()
        data = encode(plan)
        t3 = clock()
        plan_decoder.decode(data)
        t4 = clock()
        ids = [req.req_id for req in out.samplers]
        reply = encode(StepResult(step_id=plan.step_id, req_ids=ids, token_ids=[7] * len(ids), epoch=EPOCH))
        result = decoder.decode(reply)
        t5 = clock()
        batch = sched.update_from_result(out, result)
        t6 = clock()
        tokens = encode(batch)
        t7 = clock()
        for name, t in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)):
            parts[name] += t
        for name, blob in zip(sizes, (data, log, reply, tokens)):
            sizes[name] += len(blob)

    for _ in range(5):  # the prefills, then decodes only
        step()
    for d in (parts, sizes):
        d.update(dict.fromkeys(d, 0))
    num_steps = 200
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(num_steps):
        step()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(f"in one process, {args.num_requests} decodes per step: {1e3 * cpu / num_steps:.3f} ms of CPU time per "
          f"step ({1e3 * wall / num_steps:.3f} ms wall)")
    print("  per step, wall: " + ", ".join(f"{name} {1e3 * t / num_steps:.3f} ms" for name, t in parts.items()))
    print("  per step, on the wire: " + ", ".join(f"{name} {n / num_steps:.0f} bytes" for name, n in sizes.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scheduler-args", default="", help="more flags for the scheduler")
    args = parser.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="folio-bs-", dir="/tmp")
    env = {**os.environ, "FOLIO_RUN_DIR": run_dir}
    scheduler_flags = ["--max-num-seqs", str(args.num_requests), "--max-num-batched-tokens", "8192",
                       *args.scheduler_args.split()]
    procs = [subprocess.Popen([sys.executable, "-m", f"folio.services.{name}.main", "--log-level", "warning", *flags],
                              env=env)
             for name, flags in (("kvmanager", []), ("scheduler", scheduler_flags))]
    try:
        asyncio.run(run(args, Endpoints.ipc(run_dir)))
        meter = CpuMeter()
        in_process(args)
        print(f"CPU: {meter.lap()}")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

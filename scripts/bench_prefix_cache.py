"""Prefix caching and forks, measured in one run.

1. Time to first token on a shared-system-prompt workload, with and without prefix caching: the
   real back half (kvmanager + executor + scheduler over ipc://, in this process) serves requests
   that share a long system prompt and differ in a short question, one after the other.
2. KV blocks held by n=4 samples of one prompt: forked from one prefill (shared blocks,
   copy-on-write of the partly filled last block) against 4 independent requests, with and
   without prefix caching. The scheduler does not fork for n>1 yet (the next issue), so this part
   drives the kvmanager's batched API (``KVStepRequest.forks``) directly.

    python scripts/bench_prefix_cache.py [--model PATH] [--num-requests 8] [--system-tokens 800]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time

import zmq
import zmq.asyncio

from services.executor.prepare import resolve_model
from services.executor.runner import ModelRunner
from services.executor.service import ExecutorService
from services.kvmanager.allocator import BlockAllocator
from services.kvmanager.service import KVManagerService, apply_step
from services.scheduler.service import SchedulerService
from shared.config import (DEFAULT_MODEL_NAME, Endpoints, ExecutorServiceConfig, KVManagerConfig, RuntimeConfig,
                           SchedulerConfig)
from shared.messages import EngineRequest, KVStepRequest, SamplingParams, TokenBatch
from shared.transport import Decoder, encode, make_socket

SYSTEM = ("You are the assistant of a city library. Answer briefly and politely. The library opens at nine "
          "and closes at six, keeps its maps in the cold room below the reading hall, lends at most five "
          "books per card, and asks visitors to leave bags in the lockers by the entrance. ")
QUESTIONS = ["When does the library open?", "Where are the maps?", "How many books can I borrow?",
             "Where do I leave my bag?", "When does it close?", "Can I bring my dog?",
             "Is there a reading hall?", "Who keeps the maps?", "Do you lend films?", "Is it open on Sunday?"]


async def measure_ttft(model_path: str, runner: ModelRunner, prompts: list[list[int]], caching: bool) -> list[float]:
    """Serve ``prompts`` one after the other; seconds from submit to the first token of each."""
    run_dir = tempfile.mkdtemp(prefix="folio-b-", dir="/tmp")
    ep = Endpoints.ipc(run_dir)
    ctx = zmq.asyncio.Context()
    rt = runner.config
    services = [
        KVManagerService(KVManagerConfig(endpoints=ep, enable_prefix_caching=caching), ctx),
        ExecutorService(ExecutorServiceConfig(endpoints=ep, runtime=rt, model_path=model_path), ctx, runner=runner),
        SchedulerService(SchedulerConfig(endpoints=ep, max_num_seqs=rt.max_num_seqs,
                                         max_num_batched_tokens=rt.max_num_batched_tokens), ctx),
    ]
    tasks = [asyncio.ensure_future(s.run()) for s in services]
    to_scheduler = make_socket(ctx, zmq.PUSH, ep.scheduler_in)
    from_scheduler = make_socket(ctx, zmq.PULL, ep.tokenizer_in)
    decoder, params = Decoder(TokenBatch), SamplingParams(temperature=0.0, max_tokens=1)
    ttfts = []
    try:
        for i, prompt in enumerate(prompts):
            req_id = f"{'on' if caching else 'off'}-{i}"
            t0 = time.perf_counter()
            await to_scheduler.send(encode(EngineRequest(req_id=req_id, prompt_token_ids=prompt, sampling=params)))
            while not any(d.req_id == req_id and d.token_ids for d in decoder.decode(await from_scheduler.recv()).deltas):
                pass
            ttfts.append(time.perf_counter() - t0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
    return ttfts


def blocks_for_samples(num_prompt: int, num_samples: int, num_new: int, block_size: int) -> dict[str, int]:
    """Device blocks held once every sample has ``num_new`` tokens after the prompt."""
    prompt = list(range(1000, 1000 + num_prompt))
    held = {}
    for name, caching in (("independent, no prefix caching", False), ("independent, prefix caching", True)):
        alloc = BlockAllocator(num_blocks=4096, block_size=block_size, enable_prefix_caching=caching)
        for s in range(num_samples):  # one after the other, as separate requests would arrive
            apply_step(alloc, KVStepRequest(step_id=s, allocate=[(f"r{s}", num_prompt + num_new)],
                                            new_token_ids={f"r{s}": prompt + [s] * num_new}))
        held[name] = alloc.num_used_blocks
    alloc = BlockAllocator(num_blocks=4096, block_size=block_size)
    apply_step(alloc, KVStepRequest(step_id=0, allocate=[("s0", num_prompt)], new_token_ids={"s0": prompt}))
    forks = [("s0", f"s{s}") for s in range(1, num_samples)]
    reply = apply_step(alloc, KVStepRequest(step_id=1, forks=forks, allocate=[(f"s{s}", num_prompt + num_new)
                                                                             for s in range(num_samples)]))
    held[f"forked from one prefill ({len(reply.block_copies)} copy-on-write copies)"] = alloc.num_used_blocks
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=800)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    system: list[int] = []
    while len(system) < args.system_tokens:
        system += tokenizer.encode(SYSTEM)
    system = system[:args.system_tokens]
    prompts = [system + tokenizer.encode(" User: " + QUESTIONS[i % len(QUESTIONS)] + " Assistant:")
               for i in range(args.num_requests)]
    runner = ModelRunner(RuntimeConfig(model=model_path, block_size=args.block_size, num_kv_blocks=512,
                                       max_num_batched_tokens=2048, max_num_seqs=8), model_path)
    asyncio.run(measure_ttft(model_path, runner, [prompts[0][-32:]], caching=False))  # warm-up
    print(f"model {args.model} on {runner.device} ({runner.dtype}), block size {args.block_size}; "
          f"{args.num_requests} requests, {args.system_tokens}-token system prompt + ~{len(prompts[0]) - len(system)}"
          "-token question, one after the other")
    results = {}
    for caching in (False, True):
        results[caching] = asyncio.run(measure_ttft(model_path, runner, prompts, caching))
    print(f"{'TTFT (ms)':<28}{'first':>10}{'later mean':>12}{'later median':>14}")
    for caching in (False, True):
        t = [x * 1000 for x in results[caching]]
        print(f"{'prefix caching ' + ('on' if caching else 'off'):<28}{t[0]:>10.1f}{statistics.mean(t[1:]):>12.1f}"
              f"{statistics.median(t[1:]):>14.1f}")
    speedup = statistics.mean(results[False][1:]) / statistics.mean(results[True][1:])
    print(f"later requests: {speedup:.1f}x faster to first token with prefix caching")
    print()
    num_prompt, num_new = 1000, 64
    print(f"KV blocks held by 4 samples of one {num_prompt}-token prompt, {num_new} new tokens each "
          f"(block size {args.block_size}; kvmanager API driven directly: the scheduler does not fork for n>1 yet)")
    for name, num in blocks_for_samples(num_prompt, 4, num_new, args.block_size).items():
        print(f"  {name:<52}{num:>6} blocks")


if __name__ == "__main__":
    main()

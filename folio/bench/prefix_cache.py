"""Prefix caching and forks, measured in one run.

1. Time to first token on a shared-system-prompt workload, with and without prefix caching: the
   real back half (kvmanager + executor + scheduler over ipc://, in this process) serves requests
   that share a long system prompt and differ in a short question, one after the other.
2. KV blocks held by n=4 samples of one prompt, at the peak, served by the same back half: one
   request with four choices (forked from one prefill: shared blocks, copy-on-write of the partly
   filled last block) against 4 independent requests sent together, with and without prefix
   caching.

More in docs/modules.md (folio/bench/prefix_cache.py).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time

from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import DEFAULT_MODEL_NAME, RuntimeConfig
from folio.shared.messages import TokenBatch
from folio.shared.sampling import SamplingParams
from folio.core.model_files import resolve_model
from folio.shared.transport import Decoder
from folio.services.in_process import back_half

# the back half's limits (its pool is the runner's, made in main)
LIMITS = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=2048)

SYSTEM = ("You are the assistant of a city library. Answer briefly and politely. The library opens at nine "
          "and closes at six, keeps its maps in the cold room below the reading hall, lends at most five "
          "books per card, and asks visitors to leave bags in the lockers by the entrance. ")
QUESTIONS = ["When does the library open?", "Where are the maps?", "How many books can I borrow?",
             "Where do I leave my bag?", "When does it close?", "Can I bring my dog?",
             "Is there a reading hall?", "Who keeps the maps?", "Do you lend films?", "Is it open on Sunday?"]


async def measure_ttft(model_path: str, runner: ModelRunner, prompts: list[list[int]], caching: bool) -> list[float]:
    """Serve ``prompts`` one after the other; seconds from submit to the first token of each."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    decoder, ttfts = Decoder(TokenBatch), []
    async with back_half(model_path, runner=runner, enable_prefix_caching=caching, **LIMITS) as bh:
        for i, prompt in enumerate(prompts):
            req_id = f"{'on' if caching else 'off'}-{i}"
            t0 = time.perf_counter()
            await bh.submit(req_id, prompt, params)
            while not any(d.req_id == req_id and d.token_ids
                          for d in decoder.decode(await bh.from_scheduler.recv()).all_deltas()):
                pass
            ttfts.append(time.perf_counter() - t0)
    return ttfts


async def peak_blocks_for_samples(model_path: str, runner: ModelRunner, prompt: list[int], num_samples: int,
                                  num_new: int, forked: bool, caching: bool) -> int:
    """Most device blocks in use while ``num_samples`` samples of ``prompt`` run to ``num_new`` tokens."""
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=num_new, ignore_eos=True)
    ids = [f"s{i}" for i in range(num_samples)]
    decoder = Decoder(TokenBatch)
    async with back_half(model_path, runner=runner, enable_prefix_caching=caching, **LIMITS) as bh:
        if forked:
            await bh.submit(ids[0], prompt, params, fork_req_ids=ids[1:])
        else:
            for i, req_id in enumerate(ids):
                await bh.submit(req_id, prompt, params.with_seed_offset(i))
        kvmanager = bh.services[0]
        pending, peak = set(ids), 0
        while pending:
            for d in decoder.decode(await bh.from_scheduler.recv()).deltas:  # finishes are never plain
                if d.finish_reason is not None:
                    pending.discard(d.req_id)
            peak = max(peak, kvmanager.allocator.num_used_blocks)
    return peak


async def serve_once(model_path: str, runner: ModelRunner, prompt: list[int]) -> tuple[float, list[int], dict]:
    """One request on a fresh back half: seconds to its first token, its output, the kvmanager's stats."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    decoder, out = Decoder(TokenBatch), []
    async with back_half(model_path, runner=runner, **LIMITS) as bh:
        t0 = time.perf_counter()
        await bh.submit("disk", prompt, params)
        ttft, done = None, False
        while not done:
            for d in decoder.decode(await bh.from_scheduler.recv()).all_deltas():
                if d.req_id == "disk":
                    out += d.token_ids
                    ttft = ttft if ttft is not None or not out else time.perf_counter() - t0
                    done = done or d.finish_reason is not None
        kv = (await bh.admin("kvmanager", "stats")).data
    return ttft, out, kv


def disk_restart(model_path: str, prompt: list[int], disk_dir: str) -> None:
    def fresh() -> ModelRunner:
        return ModelRunner(RuntimeConfig(model=model_path, num_kv_blocks=512, kv_disk_dir=disk_dir, **LIMITS),
                           model_path)

    runner = fresh()
    shutil.rmtree(runner.tiers.disk.dir, ignore_errors=True)  # this model's folder in it: a cold start
    runner.tiers.disk.rescan()
    asyncio.run(serve_once(model_path, runner, prompt[-40:][::-1]))  # warm-up, another prefix
    cold, out_cold, _ = asyncio.run(serve_once(model_path, runner, prompt))
    del runner
    warm, out_warm, kv = asyncio.run(serve_once(model_path, fresh(), prompt))
    disk = kv["tiers"]["disk"]
    print(f"{len(prompt)}-token prompt, disk tier {disk_dir}: cold TTFT {cold * 1000:.0f} ms, after a restart "
          f"{warm * 1000:.0f} ms: {warm / cold:.3f}x; disk hit blocks {disk['hit_blocks']} "
          f"({disk['blocks_cached']} blocks, {disk['bytes'] / 1e6:.1f} MB on disk); "
          f"outputs equal: {out_cold == out_warm}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=800)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-disk-dir", default=None, help="measure the disk tier across a restart instead")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model_path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    system: list[int] = []
    while len(system) < args.system_tokens:
        system += tokenizer.encode(SYSTEM)
    system = system[:args.system_tokens]
    prompts = [system + tokenizer.encode(" User: " + QUESTIONS[i % len(QUESTIONS)] + " Assistant:")
               for i in range(args.num_requests)]
    LIMITS["block_size"] = args.block_size
    if args.kv_disk_dir:
        disk_restart(model_path, prompts[0], args.kv_disk_dir)
        return
    runner = ModelRunner(RuntimeConfig(model=model_path, num_kv_blocks=512, **LIMITS), model_path)
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
    num_new = 64
    prompt = (system + tokenizer.encode(" User: Tell me everything. Assistant:"))[:1000]
    print(f"peak KV blocks held by 4 samples of one {len(prompt)}-token prompt, {num_new} new tokens each "
          f"(block size {args.block_size})")
    cases = [("4 independent requests, no prefix caching", False, False),
             ("4 independent requests, prefix caching", False, True),
             ("1 request, n=4: forked from one prefill", True, True)]
    peaks = {}
    for name, forked, caching in cases:
        peaks[name] = asyncio.run(peak_blocks_for_samples(model_path, runner, prompt, 4, num_new, forked, caching))
        print(f"  {name:<52}{peaks[name]:>6} blocks")
    base = peaks[cases[0][0]]
    print(f"forked samples hold {base / peaks[cases[2][0]]:.2f}x fewer blocks than independent ones")

if __name__ == "__main__":
    main()

"""Serving benchmark: many concurrent streams over HTTP against the runtime driven in-process.

One run, one machine, the same mixed workload (prompt and output lengths varying by 10x):
1. in-process: the executor runtime driven directly (``services.executor.offline``), all requests
   batched together, as an upper bound for what the services can deliver;
2. served: ``folio serve`` started here, every request a streaming HTTP client (aiohttp), all
   sent at once. Prints request throughput, output tokens/s, time to first token and inter-token
   latency percentiles, and the served/in-process throughput ratio (the cost of services and
   sockets).

    python scripts/bench_serving.py [--num-requests 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.executor.offline import generate  # noqa: E402
from services.executor.prepare import resolve_model  # noqa: E402
from services.executor.runner import ModelRunner  # noqa: E402
from shared.config import DEFAULT_MODEL_NAME, RuntimeConfig  # noqa: E402
from shared.messages import SamplingParams  # noqa: E402
from tests.e2e.conftest import start_server, stop_server  # noqa: E402

WORDS = ("river mountain city code model light quiet storm paper engine story garden window "
         "morning silver market bridge winter signal harbor").split()


def workload(tokenizer, num: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length): prompts 16..160 tokens, outputs 8..80 tokens."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(num):
        prompt_len, out_len = rng.randint(16, 160), rng.randint(8, 80)
        words = " ".join(rng.choice(WORDS) for _ in range(prompt_len * 2))
        jobs.append((tokenizer.encode(words)[:prompt_len], out_len))
    return jobs


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_in_process(path: str, jobs, num_kv_blocks: int) -> float:
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=num_kv_blocks), path)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in jobs]
    generate(runner, [jobs[0][0]], params[0])  # warm-up
    t0 = time.perf_counter()
    generate(runner, [p for p, _ in jobs], params)
    return time.perf_counter() - t0


async def one_stream(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "end": stamps[-1]}


async def run_served(base_url: str, jobs) -> tuple[float, list[dict]]:
    import aiohttp

    url = base_url + "/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await one_stream(session, url, jobs[0][0], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, url, p, n) for p, n in jobs))
    return time.perf_counter() - t0, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    path = str(resolve_model(args.model))
    jobs = workload(AutoTokenizer.from_pretrained(path), args.num_requests, args.seed)
    out_tokens = sum(n for _, n in jobs)
    print(f"workload: {len(jobs)} requests, prompts {min(len(p) for p, _ in jobs)}-{max(len(p) for p, _ in jobs)} "
          f"tokens, outputs {min(n for _, n in jobs)}-{max(n for _, n in jobs)} tokens, {out_tokens} output tokens")

    local_s = run_in_process(path, jobs, args.num_kv_blocks)
    server = start_server(path, "--num-kv-blocks", str(args.num_kv_blocks),
                          "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                          "--max-num-seqs", str(max(256, len(jobs))))
    try:
        served_s, results = asyncio.run(run_served(server.base_url, jobs))
    finally:
        stop_server(server)

    ttfts = [r["ttft"] for r in results]
    itls = [x for r in results for x in r["itl"]]
    print(f"{'':<12} {'req/s':>8} {'out tok/s':>10}")
    print(f"{'in-process':<12} {len(jobs) / local_s:>8.2f} {out_tokens / local_s:>10.1f}")
    print(f"{'served':<12} {len(jobs) / served_s:>8.2f} {out_tokens / served_s:>10.1f}")
    print(f"served / in-process throughput: {local_s / served_s:.3f} (services and sockets cost "
          f"{100 * (1 - local_s / served_s):.1f}%)")
    print(f"TTFT   p50 {pct(ttfts, .5) * 1e3:8.1f} ms  p90 {pct(ttfts, .9) * 1e3:8.1f} ms  p99 {pct(ttfts, .99) * 1e3:8.1f} ms")
    print(f"ITL    p50 {pct(itls, .5) * 1e3:8.1f} ms  p90 {pct(itls, .9) * 1e3:8.1f} ms  p99 {pct(itls, .99) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

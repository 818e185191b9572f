"""The KV-cache-aware router against round-robin routing, measured in one run.

More in docs/modules.md (folio/bench/router.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time

import aiohttp

from folio.bench.cpu_meter import CpuMeter
from folio.shared.config import DEFAULT_MODEL_NAME
from folio.core.model_files import resolve_model
from folio.testing.routerstack import ReplicaProcess, start_router

TOPICS = ["harbour", "orchard", "observatory", "bakery", "railway", "museum", "vineyard", "glacier",
          "lighthouse", "monastery", "brewery", "aquarium"]


def system_prompt(group: int, num_tokens: int, tokenizer) -> str:
    """A distinct system prompt of about ``num_tokens`` tokens for group ``group``."""
    topic = TOPICS[group % len(TOPICS)]
    rules, i = [f"You are the assistant of the {topic} number {group}."], 0
    while len(tokenizer.encode(" ".join(rules))) < num_tokens:
        rules.append(f"Rule {i} of the {topic}: answer question {i} briefly, cite section {i * 7 % 31}, "
                     f"and never discuss the {TOPICS[(group + i) % len(TOPICS)]}.")
        i += 1
    return " ".join(rules)


async def one_request(session: aiohttp.ClientSession, url: str, system: str, question: str,
                      max_tokens: int) -> tuple[float, int]:
    """(seconds to the first content token, output tokens) of one streamed chat request."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    ttft, num_out = None, 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                num_out = chunk["usage"]["completion_tokens"]
    return ttft if ttft is not None else time.perf_counter() - t0, num_out


async def run_workload(url: str, systems: list[str], rounds: int, max_tokens: int) -> dict:
    ttfts: dict[int, list[float]] = {r: [] for r in range(rounds)}
    num_out = 0
    t0 = time.perf_counter()
    rng = random.Random(0)  # the same orders for both policies
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for r in range(rounds):
            order = list(range(len(systems)))
            rng.shuffle(order)
            results = await asyncio.gather(*(one_request(session, url, systems[g], f"Question {r} of group {g}: what now?",
                                                         max_tokens) for g in order))
            ttfts[r] = [t for t, _ in results]
            print(f"  round {r}: mean TTFT {statistics.mean(ttfts[r]):.2f} s", flush=True)
            num_out += sum(n for _, n in results)
    wall = time.perf_counter() - t0
    later = [t for r in range(1, rounds) for t in ttfts[r]]
    return {"later_ttft": statistics.mean(later), "later_p90": sorted(later)[int(0.9 * (len(later) - 1))],
            "first_ttft": statistics.mean(ttfts[0]), "req_s": len(systems) * rounds / wall,
            "tok_s": num_out / wall, "wall": wall}


async def warm_up(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one_request(session, url, f"Warm-up {i}. " * 60, "Hello?", 2) for i in range(2)))


def cache_counters(replicas: list[ReplicaProcess]) -> list[tuple[int, int]]:
    return [(s["num_prefix_cache_hits"], s["num_prefix_cache_queries"])
            for s in (r.admin("kvmanager", "stats") for r in replicas)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--groups", type=int, default=4, help="conversations, each with its own system prompt")
    parser.add_argument("--rounds", type=int, default=3, help="questions per conversation")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="per replica (default: room for a bit more than half the groups' prefixes)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    systems = [system_prompt(g, args.system_tokens, tokenizer) for g in range(args.groups)]
    num_system_tokens = statistics.mean(len(tokenizer.encode(s)) for s in systems)
    num_blocks = args.num_kv_blocks or int((args.groups / 2 + 1.5) * (num_system_tokens / 16 + 4))
    print(f"workload: {args.groups} conversations x {args.rounds} rounds, system prompts ~{num_system_tokens:.0f} "
          f"tokens, {args.max_tokens} output tokens, streamed; 2 replicas of {num_blocks} KV blocks x 16 tokens",
          flush=True)
    flags = ("--served-model-name", "m", "--num-kv-blocks", str(num_blocks), "--max-num-seqs", "8",
             "--log-level", "error")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still stops the replicas
    replicas = [ReplicaProcess(model, flags).start() for _ in range(2)]
    results = {}
    try:
        for r in replicas:
            r.wait_ready(timeout_s=600)
        for r in replicas:  # the first forward passes are slower: not part of either run
            asyncio.run(warm_up(r.url))
        print("replicas ready and warm", flush=True)
        meter = CpuMeter()
        for policy in ("round_robin", "cache_aware"):
            for r in replicas:
                r.admin("kvmanager", "clear")
            before = cache_counters(replicas)
            router = start_router(model, replicas, "--policy", policy)
            try:
                results[policy] = run_workload_sync(router.url, systems, args)
            finally:
                router.stop()
            print(f"{policy}: {results[policy]['wall']:.0f} s", flush=True)
            after = cache_counters(replicas)
            results[policy]["cache"] = [(h1 - h0, q1 - q0) for (h0, q0), (h1, q1) in zip(before, after)]
            results[policy]["cpu"] = meter.lap()
    finally:
        for r in replicas:
            r.cleanup()
    report(results)
    return 0


def run_workload_sync(url: str, systems: list[str], args) -> dict:
    return asyncio.run(run_workload(url, systems, args.rounds, args.max_tokens))


def report(results: dict) -> None:
    print(f"\n{'policy':<12} {'later TTFT':>11} {'p90':>9} {'first-round':>12} {'req/s':>7} {'out tok/s':>10}  "
          f"replica prefix cache (cached / asked tokens)")
    for policy, r in results.items():
        cache = "  ".join(f"{h}/{q} ({h / q:.0%})" if q else "0/0" for h, q in r["cache"])
        print(f"{policy:<12} {r['later_ttft'] * 1e3:8.0f} ms {r['later_p90'] * 1e3:6.0f} ms {r['first_ttft'] * 1e3:9.0f} ms "
              f"{r['req_s']:7.2f} {r['tok_s']:10.1f}  {cache}")
    for policy, r in results.items():
        print(f"  {policy}: {r['cpu']}")
    rr, ca = results["round_robin"], results["cache_aware"]
    print(f"cache-aware / round-robin: later-request TTFT {ca['later_ttft'] / rr['later_ttft']:.2f}x, "
          f"throughput {ca['req_s'] / rr['req_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())

"""Soak: sustained load on a real ``folio serve`` while a service is killed every N seconds.

Requests arrive as a Poisson process at ``--rate`` per second, above what the server can do, so
the queue limit (``--max-queue-len``) is exercised and refuses some with 429. Every
``--kill-every`` seconds the next service of ``--kill`` (in turn) gets SIGKILL; ``folio serve``
restarts it. Each request has a client deadline (``--request-timeout`` plus a margin).

More in docs/modules.md (folio/bench/soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter

import aiohttp
import psutil

from folio.testing.faults import SERVICES, Served, start_serve, stream, workload_specs
from folio.bench.cpu_meter import CpuMeter
from folio.bench.serving import pct


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills")
    p.add_argument("--kill", default="executor,kvmanager,scheduler,tokenizer", help="services killed in turn")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-queue-len", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--model", default=None, help="a model folder (default: a tiny random model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem-every", type=float, default=60.0, help="seconds between the gateway's memory samples")
    p.add_argument("--check", action="store_true", help="exit 1 when a request was lost or a block leaked")
    return p.parse_args(argv)


def tiny_model() -> str:
    from folio.core.model_files import prepare_default_model
    from folio.testing.models import write_tiny_chat_model

    return write_tiny_chat_model(tempfile.mkdtemp(prefix="folio-soak-"), str(prepare_default_model()))


def memory(served: Served) -> dict[str, tuple[int, float]]:
    """Service -> (pid, resident MiB)."""
    out = {}
    for name in SERVICES:
        try:
            proc = served.child(name)
            out[name] = (proc.pid, proc.memory_info().rss / 2**20)
        except (LookupError, psutil.Error):
            out[name] = (0, float("nan"))
    return out


async def killer(served: Served, names: list[str], every_s: float, stop: asyncio.Event, log: list[str],
                 kill_times: list[float] | None = None) -> None:
    i = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            pass
        name = names[i % len(names)]
        i += 1
        try:
            served.child(name).kill()
            log.append(f"{time.strftime('%H:%M:%S')} killed the {name}")
            if kill_times is not None:
                kill_times.append(time.monotonic())
        except (LookupError, psutil.Error):
            log.append(f"{time.strftime('%H:%M:%S')} no {name} to kill (restarting)")


async def warm_up(served: Served, max_tokens: int) -> None:
    async with aiohttp.ClientSession() as http:
        specs = workload_specs(max_tokens)
        await asyncio.gather(*(stream(http, served.base, route, body, 120) for route, body in specs))


async def sample_memory(served: Served, every_s: float, stop: asyncio.Event, samples: list[float],
                        blocks: list[int]) -> None:
    while True:
        samples.append(memory(served)["gateway"][1])
        blocks.append(await asyncio.to_thread(python_blocks, served))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            pass


def python_blocks(served: Served) -> int:
    """The gateway's blocks in Python's small-object allocator (-1 when it does not answer)."""
    try:
        return served.admin("gateway", "stats")["python_allocated_blocks"]
    except Exception:  # noqa: BLE001 - a busy gateway missing the admin deadline is a gap, not an error
        return -1


async def timed_stream(http, base: str, route: str, body: dict, deadline_s: float):
    t0 = time.monotonic()
    return t0, await stream(http, base, route, body, deadline_s)


async def load(served: Served, args, gateway_mib: list[float],
               gateway_blocks: list[int]) -> tuple[Counter, list[float], Counter, dict]:
    rng = random.Random(args.seed)
    specs = workload_specs(args.max_tokens)
    deadline_s = args.request_timeout + 15
    tasks: list[asyncio.Task] = []
    stop = asyncio.Event()
    kills: list[str] = []
    kill_times: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        kill_task = asyncio.ensure_future(killer(served, args.kill.split(","), args.kill_every, stop, kills,
                                                 kill_times))
        mem_task = asyncio.ensure_future(sample_memory(served, args.mem_every, stop, gateway_mib, gateway_blocks))
        t_end = time.monotonic() + args.duration
        while time.monotonic() < t_end:
            route, body = specs[rng.randrange(len(specs))]
            tasks.append(asyncio.ensure_future(timed_stream(http, served.base, route, body, deadline_s)))
            await asyncio.sleep(rng.expovariate(args.rate))
        stop.set()
        await kill_task
        await mem_task
        timed = await asyncio.gather(*tasks)
    for line in kills:
        print(line)
    outcomes = [o for _, o in timed]
    kinds = Counter("completed" if o.kind == "ok" else "errored" if o.kind == "error" else "lost" for o in outcomes)
    statuses = Counter(o.status for o in outcomes if o.kind == "error")
    hit, clear = [], []  # completed: in flight at a kill, or not
    for t0, o in timed:
        if o.kind == "ok":
            (hit if any(t0 <= k <= t0 + o.elapsed_s for k in kill_times) else clear).append(o.elapsed_s)
    kill_cost = {"hit": hit, "clear": clear,
                 "failed_mid_stream": sum(o.kind == "error" and o.status == 200 for o in outcomes),
                 "mid_stream_errors": Counter(o.error.split(";")[0] for o in outcomes
                                              if o.kind == "error" and o.status == 200)}
    return kinds, [o.elapsed_s for o in outcomes if o.kind == "ok"], statuses, kill_cost


def main(argv=None) -> int:
    args = parse_args(argv)
    served = start_serve(args.model or tiny_model(), "--num-kv-blocks", "1024", "--max-num-seqs", "64",
                         "--max-queue-len", str(args.max_queue_len), "--request-timeout", str(args.request_timeout),
                         "--max-restarts", "1000")
    try:
        asyncio.run(warm_up(served, args.max_tokens))  # memory at the start: after each kind of request ran once
        meter = CpuMeter()
        mem_start = memory(served)
        gateway_mib: list[float] = []
        gateway_blocks: list[int] = []
        kinds, latencies, statuses, kill_cost = asyncio.run(load(served, args, gateway_mib, gateway_blocks))
        served.wait_healthy()
        leaked = served.wait_idle(60)["num_blocks_used"]
        mem_end = memory(served)
        print(f"soak: {args.duration:.0f} s at {args.rate:g} req/s, a kill every {args.kill_every:g} s "
              f"({args.kill}); {meter.lap()}")
        total = sum(kinds.values())
        print(f"requests: {total}  completed {kinds['completed']}  errored {kinds['errored']} "
              f"(by status: {dict(sorted(statuses.items()))})  lost {kinds['lost']}")
        print(f"latency of the completed: p50 {pct(latencies, 0.5):.2f} s  p99 {pct(latencies, 0.99):.2f} s")
        hit, clear = kill_cost["hit"], kill_cost["clear"]
        if hit and clear:
            print(f"cost of a kill: {len(hit)} completed requests were in flight at a kill: p50 {pct(hit, 0.5):.2f} s "
                  f"p99 {pct(hit, 0.99):.2f} s, against p50 {pct(clear, 0.5):.2f} s p99 {pct(clear, 0.99):.2f} s for "
                  f"the {len(clear)} others (p99 {pct(hit, 0.99) - pct(clear, 0.99):+.2f} s)")
        print(f"failed after their stream began: {kill_cost['failed_mid_stream']} "
              f"{dict(kill_cost['mid_stream_errors'])}")
        print(f"KV blocks in use after the load: {leaked}")
        print("resident memory (MiB), start -> end:")
        for name in SERVICES:
            (pid0, mb0), (pid1, mb1) = mem_start[name], mem_end[name]
            again = "" if pid0 == pid1 else f" (restarted: pid {pid0} -> {pid1})"
            print(f"  {name:<10} {mb0:7.1f} -> {mb1:7.1f}{again}")
        gateway_mib.append(mem_end["gateway"][1])
        half = gateway_mib[len(gateway_mib) // 2]
        print(f"gateway resident memory every {args.mem_every:g} s (MiB): "
              + " ".join(f"{mb:.1f}" for mb in gateway_mib))
        print(f"gateway growth: first half {half - gateway_mib[0]:+.1f} MiB, "
              f"second half {gateway_mib[-1] - half:+.1f} MiB")
        gateway_blocks.append(python_blocks(served))
        print(f"gateway blocks in Python's allocator every {args.mem_every:g} s: "
              + " ".join(str(b) for b in gateway_blocks))
    finally:
        served.stop()
    if args.check and (kinds["lost"] or leaked or kill_cost["failed_mid_stream"]):
        print("soak: FAILED (a request was lost, failed mid-stream, or a block leaked)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Disaggregated serving's figures.

1. KV transfer over tcp loopback (``kv_transfer``, ZeroMQ frames): a sender and a receiver pool
   of SmolLM2-135M's layout (30 layers, 3 KV heads of 64, bf16, 16-token blocks); GB/s of block
   bytes landed in the receiver's pool, confirmations included. Target: >= 1 GB/s. Each end has a
   ZeroMQ context of its own (its own I/O thread), as two processes do; the same with one shared
   context is printed beside it.
2. Inter-token latency of 8 decode streams while 2,000-token prompts keep arriving, colocated
   (one ``folio serve``) against disaggregated (a prefill and a decode instance behind the
   router), in the same run: p50/p99 of the gaps between a stream's chunks. Reported, not
   targeted, on a CPU (prefill and decode share the same cores there).

    python scripts/bench_disagg.py [--blocks 256] [--reps 5] [--skip-serving] [--streams 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.core.kv.tensors.transfer import KVLayout
from folio.services.executor.kv_sockets import KVReceiver, KVSender
from folio.shared.curve import release

SHAPE = PoolShape(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)


def tcp_throughput(num_blocks: int, reps: int, one_context: bool = False) -> dict:
    src = KVPool(SHAPE, num_blocks, torch.device("cpu"))
    dst = KVPool(SHAPE, num_blocks, torch.device("cpu"))
    for k, v in src.kv_caches:
        k.normal_(), v.normal_()
    # a ZeroMQ context (its I/O thread) each, as two processes have; ``one_context``: one I/O
    # thread carries both ends of the loopback
    ctx = zmq.Context()
    receiver_ctx = ctx if one_context else zmq.Context()
    sender = KVSender(src, KVLayout.of(src), ctx=ctx)
    receiver = KVReceiver(dst, KVLayout.of(dst), timeout_s=60, ctx=receiver_ctx)
    ids = list(range(num_blocks))
    try:
        receiver.pull(sender.export(ids), ids)  # warm: connections, first-touch pages
        times = []
        for _ in range(reps):
            handle = sender.export(ids)
            t0 = time.perf_counter()
            moved = receiver.pull(handle, ids)
            times.append(time.perf_counter() - t0)
        assert torch.equal(src.kv_caches[7][1].view(torch.uint8), dst.kv_caches[7][1].view(torch.uint8))
    finally:  # every socket closed and each context's key handler stopped, or terminating it waits forever
        sender.close()
        receiver.close()
        for c in {ctx, receiver_ctx}:
            release(c)
            c.term()
    best, median = min(times), statistics.median(times)
    return {"bytes": moved, "median_s": round(median, 4), "gb_per_s_median": round(moved / median / 1e9, 2),
            "gb_per_s_best": round(moved / best / 1e9, 2)}


# ---------------------------------------------------------------------- serving
def _stream_gaps(url: str, body: dict) -> list[float]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    gaps, last = [], None
    with urllib.request.urlopen(req, timeout=900) as resp:
        for line in resp:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


def itl_under_prefills(url: str, streams: int, max_tokens: int, prompt_tokens: int, interval_s: float) -> dict:
    words = " ".join(f"w{i}" for i in range(prompt_tokens // 2))  # about 2 tokens a word
    stop = threading.Event()
    arrivals = []

    def keep_arriving():
        i = 0
        pool = ThreadPoolExecutor(4)
        while not stop.is_set():
            arrivals.append(pool.submit(urllib.request.urlopen, urllib.request.Request(
                url + "/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"prompt": f"{i} {words}", "max_tokens": 2, "temperature": 0}).encode()), None, 900))
            i += 1
            stop.wait(interval_s)
        # the streams are measured: the prompts still queued here are dropped (those in flight end
        # with the server), not waited for
        pool.shutdown(wait=False, cancel_futures=True)

    feeder = threading.Thread(target=keep_arriving, daemon=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(_stream_gaps, url, {"prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}) for i in range(streams)]
        time.sleep(1.0)
        feeder.start()
        gaps = [g for f in futures for g in f.result()]
    stop.set()
    feeder.join()
    gaps.sort()
    return {"num_gaps": len(gaps), "p50_ms": round(1000 * gaps[len(gaps) // 2], 1),
            "p99_ms": round(1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 1),
            "streams_s": round(time.perf_counter() - t0, 1), "num_long_prompts_sent": len(arrivals),
            "num_long_prompts_done": sum(f.done() and not f.cancelled() and f.exception() is None for f in arrivals)}


def serving(args) -> dict:
    from folio.testing.routerstack import ReplicaProcess, start_router
    flags = ("--max-num-seqs", "16", "--num-kv-blocks", "1024", "--max-num-batched-tokens", "2048")
    out = {}
    solo = ReplicaProcess("SmolLM2-135M-Instruct", flags).start()
    try:
        solo.wait_ready(600)
        out["colocated"] = itl_under_prefills(solo.url, args.streams, args.max_tokens, args.prompt_tokens,
                                              args.interval)
    finally:
        solo.cleanup()
    p = ReplicaProcess("SmolLM2-135M-Instruct", flags + ("--kv-role", "prefill")).start()
    d = ReplicaProcess("SmolLM2-135M-Instruct", flags + ("--kv-role", "decode")).start()
    router = None
    try:
        p.wait_ready(600), d.wait_ready(600)
        router = start_router("SmolLM2-135M-Instruct", [], "--prefill", p.spec, "--decode", d.spec, num_up=2)
        out["disaggregated"] = itl_under_prefills(router.url, args.streams, args.max_tokens, args.prompt_tokens,
                                                  args.interval)
        out["disaggregated"]["kv_pulls"] = d.admin("executor", "stats").get("kv_pulls")
    finally:
        if router is not None:
            router.stop()
        p.cleanup(), d.cleanup()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks per transfer (256: 94 MB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-serving", action="store_true", help="only the transfer figures")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between long prompts")
    args = ap.parse_args(argv)
    result = {"tcp_loopback": tcp_throughput(args.blocks, args.reps),
              "tcp_loopback_one_context": tcp_throughput(args.blocks, args.reps, one_context=True)}
    print(json.dumps(result), flush=True)
    if not args.skip_serving:
        result["itl"] = serving(args)
    print(json.dumps(result, indent=2))
    tcp = result["tcp_loopback"]["gb_per_s_median"]
    print(f"tcp loopback: {tcp} GB/s (target >= 1): {'ok' if tcp >= 1 else 'below'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

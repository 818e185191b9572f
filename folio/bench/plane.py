"""What CURVE costs: served tok/s of the stack on tcp endpoints with CURVE against the same stack without it.

More in docs/modules.md (folio/bench/plane.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

from folio.bench.cpu_meter import CpuMeter
from folio.bench.serving import describe, random_prompt, run_served, workload
from folio.core.model_files import resolve_model
from folio.shared.config import DEFAULT_MODEL_NAME
from folio.shared.keys import init_keys
from folio.shared.curve import UNSAFE_ENV
from folio.testing.tcpstack import TcpStack

SERVED_NAME = "bench"
SIDES = ("curve", "clear")
CROSSINGS_PER_STEP = 3  # round trips' worth of messages per served step


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=4, help="runs per side, taking turns")
    p.add_argument("--warmup-rounds", type=int, default=1, help="uncounted runs per side first")
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--roundtrips", type=int, default=5000, help="round trips per side per round (0: skip)")
    p.add_argument("--message-bytes", type=int, default=4096)
    p.add_argument("--skip-served", action="store_true", help="only the round trips")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.num_requests < 1:
        p.error("--rounds and --num-requests must be at least 1")
    return args


def start(side: str, args, keys_dir: str) -> TcpStack:
    seqs = str(max(256, args.num_requests))
    stack = TcpStack(args.model, keys_dir, kv_role=False, dtype=None,
                     extra_env={UNSAFE_ENV: "1"} if side == "clear" else {UNSAFE_ENV: "0"},
                     flags={"executor": ("--num-kv-blocks", str(args.num_kv_blocks), "--log-level", "warning"),
                            "scheduler": ("--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                          "--max-num-seqs", seqs, "--log-level", "warning"),
                            "gateway": ("--served-model-name", SERVED_NAME, "--log-level", "warning"),
                            "tokenizer": ("--log-level", "warning"), "kvmanager": ("--log-level", "warning")})
    stack.start(timeout_s=300)
    deadline = time.monotonic() + 300
    while True:  # the executor's pool registered: the scheduler takes requests
        reply = stack.admin("scheduler", "stats")
        if reply is not None and reply.ok and reply.data.get("pool_ready", True):
            break
        if time.monotonic() > deadline or not stack.alive():
            logs = stack.log_text()
            stack.stop()
            raise RuntimeError(f"the {side} stack's pool never became ready:\n{logs[-4000:]}")
        time.sleep(0.25)
    warned = "NO CURVE" in stack.log_text()
    if warned != (side == "clear"):  # the clear stack must really be clear, the other not
        stack.stop()
        raise RuntimeError(f"the {side} stack {'warns' if warned else 'does not warn'} that CURVE is off")
    return stack


def roundtrip_us(curve: bool, n: int, size: int) -> float:
    """Microseconds per round trip of a ``size``-byte message, DEALER -> ROUTER -> DEALER over tcp
    loopback, with the stack's CURVE (``secure``) or in the clear."""
    import zmq

    from folio.shared.curve import release, secure

    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (server, client):
        sock.linger = 0
    if curve:
        secure(ctx, server, "tcp://127.0.0.1:0", bind=True, service="executor")
        secure(ctx, client, "tcp://127.0.0.1:0", bind=False, service="executor")
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    payload = os.urandom(size)
    try:
        for i in range(n // 10 + 1 + n):  # the first tenth warms up (the handshake, buffers)
            if i == n // 10 + 1:
                t0 = time.perf_counter()
            client.send(payload)
            who, got = server.recv_multipart()
            server.send_multipart([who, got])
            client.recv()
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        server.close(0)
        client.close(0)
        release(ctx)
        ctx.term()


def section_roundtrips(args, keys_dir: str) -> float:
    from folio.shared import curve

    curve.use_keys(keys_dir)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            times[side].append(roundtrip_us(side == "curve", args.roundtrips, args.message_bytes))
    med = {side: statistics.median(v) for side, v in times.items()}
    for side in SIDES:
        print(f"{side} round trip, {args.message_bytes} bytes (us): {med[side]:.1f} "
              f"(rounds: {', '.join(f'{v:.1f}' for v in times[side])})")
    print(f"CURVE adds per round trip (us): {med['curve'] - med['clear']:.1f}")
    print(f"curve / clear round trip time: {med['curve'] / med['clear']:.3f} x")
    return med["curve"] - med["clear"]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    args = parse_args(argv)
    keys_dir = tempfile.mkdtemp(prefix="folio-bench-keys-")
    init_keys(keys_dir)
    if args.skip_served:
        section_roundtrips(args, keys_dir)
        return 0
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    jobs = workload(tokenizer, args.num_requests, args.seed)
    warmup = random_prompt(tokenizer, random.Random(args.seed + 2), 24)
    num_out = sum(n for _, n in jobs)
    print(f"workload (mixed, all at once): {describe(jobs)}")
    meter = CpuMeter()
    stacks: dict[str, TcpStack] = {}
    runs: dict[str, list[float]] = {side: [] for side in SIDES}
    steps: dict[str, list[tuple[int, float]]] = {side: [] for side in SIDES}  # (steps, seconds) per run
    try:
        for side in SIDES:
            stacks[side] = start(side, args, keys_dir)
            print(f"  [{side}: five services on tcp, base port {stacks[side].base_port}, logs {stacks[side].run_dir}]")
        print(f"(start: {meter.lap()})")
        pick = [{"model": SERVED_NAME}] * len(jobs)
        for r in range(args.warmup_rounds):
            for side in SIDES:
                elapsed, _ = asyncio.run(run_served(stacks[side].http + "/v1", jobs, warmup, pick))
                print(f"warm-up {r + 1} {side}: {num_out / elapsed:.1f} tok/s (not counted)", flush=True)
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                steps0 = stacks[side].admin("scheduler", "stats", timeout_s=5.0).data["num_steps"]
                elapsed, _ = asyncio.run(run_served(stacks[side].http + "/v1", jobs, warmup, pick))
                steps[side].append((stacks[side].admin("scheduler", "stats", timeout_s=5.0).data["num_steps"] - steps0,
                                    elapsed))
                runs[side].append(num_out / elapsed)
                print(f"round {r + 1} {side}: {num_out / elapsed:.1f} tok/s ({elapsed:.1f} s)", flush=True)
            assert all(s.alive() for s in stacks.values()), "a service died"
        print(f"(runs: {meter.lap()})")
    finally:
        for stack in stacks.values():
            stack.stop()
    best = {side: max(v) for side, v in runs.items()}
    pairs = [c / k for c, k in zip(runs["curve"], runs["clear"])]
    print(f"curve tok/s: {best['curve']:.1f}")
    print(f"clear tok/s: {best['clear']:.1f}")
    print(f"curve / clear (best of each): {best['curve'] / best['clear']:.3f} x")
    print(f"curve / clear (median of the rounds): {statistics.median(pairs):.3f} x")
    print(f"| CURVE cost, mixed workload ({len(jobs)} requests, {num_out} output tokens), tcp endpoints | "
          f"{', '.join(f'{v:.1f}' for v in runs['curve'])} | {', '.join(f'{v:.1f}' for v in runs['clear'])} | "
          f"{best['curve'] / best['clear']:.3f}x (median of rounds {statistics.median(pairs):.3f}x) |")
    if args.roundtrips:
        added_us = section_roundtrips(args, keys_dir)
        print(f"(round trips: {meter.lap()})")
        num_steps = statistics.median(n for n, _ in steps["curve"])
        seconds = statistics.median(t for _, t in steps["curve"])
        share = max(0.0, added_us) * 1e-6 * CROSSINGS_PER_STEP * num_steps / seconds
        print(f"served steps per run (curve, median): {num_steps:.0f} in {seconds:.1f} s")
        print(f"estimated curve / clear from the round trips: {1 - share:.4f} x "
              f"({CROSSINGS_PER_STEP} round trips a step, {added_us:.1f} us each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

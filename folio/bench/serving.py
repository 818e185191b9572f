"""Serving benchmark: folio served over HTTP against baselines measured in the same run.

More in docs/modules.md (folio/bench/serving.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from folio import LLM, SamplingParams
from folio.shared.config import DEFAULT_MODEL_NAME, RuntimeConfig
from folio.core.model_files import resolve_model
from folio.testing.server import Server, start_server, stop_server
from folio.bench.cpu_meter import CpuMeter

SECTIONS = ("throughput", "itl", "sampling", "invariance", "concurrency")  # in the order they run
# the sampling section's sampled requests (a seed is added per request unless --no-request-seeds)
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "presence_penalty": 0.5}
WORDS = ("river mountain city code model light quiet storm paper engine story garden window "
         "morning silver market bridge winter signal harbor").split()
ITL_NUM_STREAMS = 8
ITL_WINDOW_MARGIN_S = 0.2

Job = tuple[list[int], int]  # (prompt ids, output length)


# ---------------------------------------------------------------------------- workload
def random_prompt(tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    words = " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
    ids = tokenizer.encode(words)[:num_tokens]
    assert len(ids) == num_tokens, "the word list gave too few tokens"
    return ids


def workload(tokenizer, num: int, seed: int) -> list[Job]:
    """Prompts 16..160 tokens, outputs 8..80 tokens."""
    rng = random.Random(seed)
    return [(random_prompt(tokenizer, rng, rng.randint(16, 160)), rng.randint(8, 80)) for _ in range(num)]


def describe(jobs: list[Job]) -> str:
    prompts, outs = [len(p) for p, _ in jobs], [n for _, n in jobs]
    return (f"{len(jobs)} requests, prompts {min(prompts)}-{max(prompts)} tokens ({sum(prompts)} in all), "
            f"outputs {min(outs)}-{max(outs)} tokens ({sum(outs)} in all)")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


# ---------------------------------------------------------------------------- in-process baselines
def in_process_engine(path: str, jobs: list[Job], args):
    """``folio.LLM`` with the throughput server's flags (``common_flags``), warmed up; and a
    function that times one pass of the workload through it."""
    llm = LLM(path, num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=max(256, args.num_requests), max_model_len=args.max_model_len,
              quantization=args.quantization)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in jobs]
    llm.generate({"prompt_token_ids": jobs[0][0]}, params[0], use_tqdm=False)  # warm-up

    def run() -> float:
        llm.engine.core.scheduler.clear_cache()  # every round computes its prompts (the next step drops them)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p, _ in jobs], params, use_tqdm=False)
        return time.perf_counter() - t0

    return llm, run


def hf_generate_batch(model, batch: list[Job], pad_id: int) -> None:
    """One static batch: left-padded to its longest prompt, run until its longest output."""
    import torch

    width, num_new = max(len(p) for p, _ in batch), max(n for _, n in batch)
    # ids, mask: [batch, width]
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (prompt, _) in enumerate(batch):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=num_new,
                             min_new_tokens=num_new, pad_token_id=pad_id)
    assert out.shape[1] == width + num_new


def run_hf_static(path: str, jobs: list[Job], batch_size: int, pad_id: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_generate_batch(model, jobs[:1], pad_id)  # warm-up
    t0 = time.perf_counter()
    for start in range(0, len(jobs), batch_size):
        hf_generate_batch(model, jobs[start:start + batch_size], pad_id)
    elapsed = time.perf_counter() - t0
    del model
    return elapsed


def run_hf_continuous(path: str, jobs: list[Job]) -> float:
    """transformers' own continuous batching (``ContinuousBatchingManager``, paged attention): every
    job added at once, each with its own output length, greedy, its end of sequence ignored."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(n for _, n in jobs))
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in jobs),
                          max_generated_length=config.max_new_tokens, num_requests=len(jobs))
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=config, workload_hints=hints, block=True, timeout=30) as manager:
        def finish(requests: dict[str, int]) -> None:
            while requests:
                result = manager.get_result(timeout=600)
                if result is None:
                    raise RuntimeError("transformers' continuous batching stopped before its requests ended")
                want = requests.pop(result.request_id)
                if len(result.generated_tokens) != want:
                    raise RuntimeError(f"transformers gave {len(result.generated_tokens)} tokens, not {want}")

        finish({manager.add_request(jobs[0][0], max_new_tokens=4): 4})  # warm-up
        t0 = time.perf_counter()
        finish({manager.add_request(p, max_new_tokens=n): n for p, n in jobs})
        elapsed = time.perf_counter() - t0
    del model
    return elapsed


# ---------------------------------------------------------------------------- HTTP clients
async def one_stream(session, base_url: str, prompt: list[int], max_tokens: int,
                     stamps: list[float] | None = None, sampling: dict | None = None) -> dict:
    """One streaming completion; ``stamps`` (when given) fills live with each text chunk's arrival;
    ``sampling``: body fields over the greedy default."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **(sampling or {})}
    stamps = [] if stamps is None else stamps
    t0 = time.perf_counter()
    async with session.post(base_url + "/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if "choices" not in chunk:  # an error event (a request timeout, say)
                    raise RuntimeError(f"the stream ended with {chunk}")
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "end": stamps[-1]}


async def one_completion(session, base_url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    async with session.post(base_url + "/completions", json=body) as resp:
        resp.raise_for_status()
        await resp.read()


def http_session():
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800))


async def run_served(base_url: str, jobs: list[Job], warmup: list[int],
                     sampling: list[dict] | None = None) -> tuple[float, list[dict]]:
    """All jobs at once; ``sampling``: per job, body fields over the greedy default."""
    sampling = sampling or [{}] * len(jobs)
    async with http_session() as session:
        await one_stream(session, base_url, warmup, 4, sampling=sampling[0])
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(session, base_url, p, n, sampling=extra)
                                         for (p, n), extra in zip(jobs, sampling)))
    return time.perf_counter() - t0, results


# ---------------------------------------------------------------------------- servers
class Servers:
    """Starts ``folio serve`` with the given flags, reusing the running one when its flags match.

    One server at a time per instance; each one's output goes to its own log file."""

    num_started_total = 0  # by every instance

    def __init__(self, path: str):
        self.path = path
        self.log_dir = Path(tempfile.mkdtemp(prefix="folio-bench-", dir="/tmp"))
        self.flags: tuple[str, ...] | None = None
        self.server: Server | None = None
        self.num_started = 0

    def get(self, *flags: str) -> Server:
        if self.server is not None and flags == self.flags:
            return self.server
        self.close()
        self.num_started += 1
        Servers.num_started_total += 1
        log_path = self.log_dir / f"serve-{self.num_started}.log"
        print(f"  [starting folio serve {' '.join(flags)}; log {log_path}]", flush=True)
        try:
            with open(log_path, "w") as log, _stdio_to(log):
                self.server = start_server(self.path, "--log-level", "warning", *flags)
        except RuntimeError as exc:
            tail = log_path.read_text().strip().splitlines()[-3:]
            raise RuntimeError(f"{exc}: {' | '.join(tail)}") from None
        self.flags = flags
        return self.server

    def close(self) -> None:
        if self.server is not None:
            stop_server(self.server)
        self.server, self.flags = None, None


@contextlib.contextmanager
def _stdio_to(log):
    """Children started inside inherit ``log`` as stdout and stderr (``start_server`` passes ours on)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def common_flags(args, num_kv_blocks: int, max_num_batched_tokens: int) -> list[str]:
    return ["--num-kv-blocks", str(num_kv_blocks), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--max-num-seqs", str(max(256, args.num_requests)), "--max-model-len", str(args.max_model_len),
            "--quantization", args.quantization]


# ---------------------------------------------------------------------------- section: throughput
def section_throughput(args, path: str, jobs: list[Job], warmup: list[int], pad_id: int, servers: Servers) -> None:
    print(f"\n== throughput: served folio vs in-process folio.LLM vs transformers static batches of "
          f"{args.hf_batch_size} and transformers' continuous batching")
    out_tokens = sum(n for _, n in jobs)
    hf_s = run_hf_static(path, jobs, args.hf_batch_size, pad_id)
    hf_cb_s = run_hf_continuous(path, jobs)
    flags = common_flags(args, args.num_kv_blocks, args.max_num_batched_tokens)
    # both servers and the in-process engine stay up, idle between their turns, and the three take
    # turns for --repeats rounds; the fastest of each counts (on a shared 2-core machine the speed
    # of the cores drifts between phases, and a drift only ever slows a run)
    sync_server = servers.get(*flags, "--no-async-scheduling")
    server = Servers(path).get(*flags)  # logs in a folder of its own
    llm, run_local = in_process_engine(path, jobs, args)
    local_s = sync_s = served_s = float("inf")
    results = []
    for _ in range(args.repeats):  # each round from an empty prefix cache: the same work every time
        local_s = min(local_s, run_local())
        sync_s = min(sync_s, asyncio.run(run_served(sync_server.base_url, jobs, warmup))[0])
        seconds, results = asyncio.run(run_served(server.base_url, jobs, warmup))
        served_s = min(served_s, seconds)
        for srv in (sync_server, server):
            srv.admin("kvmanager", "clear")
    del llm
    stop_server(server)

    print(f"{'':<30} {'req/s':>8} {'useful out tok/s':>17}")
    for name, seconds in ((f"transformers static B={args.hf_batch_size}", hf_s),
                          ("transformers continuous", hf_cb_s), ("in-process folio.LLM", local_s),
                          ("served folio, sync scheduling", sync_s), ("served folio (async scheduling)", served_s)):
        print(f"{name:<30} {len(jobs) / seconds:>8.2f} {out_tokens / seconds:>17.1f}")
    print(f"served / transformers static throughput: {hf_s / served_s:.2f}x")
    print(f"served / transformers continuous throughput: {hf_cb_s / served_s:.2f}x")
    for name, seconds in (("served, --no-async-scheduling", sync_s), ("served (async scheduling)", served_s)):
        print(f"{name} / in-process throughput: {local_s / seconds:.3f} (services and sockets cost "
              f"{100 * (1 - local_s / seconds):.1f}%)")
    ttfts = [r["ttft"] for r in results]
    itls = [x for r in results for x in r["itl"]]
    print(f"served TTFT  p50 {ms(pct(ttfts, .5))}  p90 {ms(pct(ttfts, .9))}  p99 {ms(pct(ttfts, .99))}")
    print(f"served ITL   p50 {ms(pct(itls, .5))}  p90 {ms(pct(itls, .9))}  p99 {ms(pct(itls, .99))}")


# ---------------------------------------------------------------------------- section: sampling
def section_sampling(args, jobs: list[Job], warmup: list[int], servers: Servers) -> None:
    runs = {"greedy": [{}] * len(jobs), "sampled, unseeded": [dict(SAMPLED)] * len(jobs)}
    if args.request_seeds:
        runs["sampled, seed on every request"] = [dict(SAMPLED, seed=args.seed + i) for i in range(len(jobs))]
    print(f"\n== sampling: {len(jobs)} streams at once through one server (async scheduling), greedy vs "
          f"{', '.join(f'{k} {v}' for k, v in SAMPLED.items())}")
    server = servers.get(*common_flags(args, args.num_kv_blocks, args.max_num_batched_tokens))
    out_tokens = sum(n for _, n in jobs)
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeats):  # taking turns: a drift of the cores' speed slows all alike
        for name, sampling in runs.items():
            best[name] = min(best[name], asyncio.run(run_served(server.base_url, jobs, warmup, sampling))[0])
            server.admin("kvmanager", "clear")
    for name, seconds in best.items():
        print(f"{name:<32} {out_tokens / seconds:>9.1f} out tok/s  {best['greedy'] / seconds:.3f} of greedy's")


def section_invariance(args, jobs: list[Job], warmup: list[int], servers: Servers) -> None:
    """The throughput workload through a server with ``--batch-invariant`` and one with
    ``--no-batch-invariant`` (the default), in turns: what a batch-independent answer costs served."""
    print(f"\n== invariance: {len(jobs)} requests at once, --batch-invariant against "
          f"--no-batch-invariant; {describe(jobs)}")
    flags = common_flags(args, args.num_kv_blocks, args.max_num_batched_tokens)
    both = {"on": servers.get(*flags, "--batch-invariant"),
            "off": Servers(servers.path).get(*flags, "--no-batch-invariant")}
    out_tokens = sum(n for _, n in jobs)
    best = {name: float("inf") for name in both}
    for _ in range(args.repeats):  # taking turns: a drift of the cores' speed slows both alike
        for name, server in both.items():
            best[name] = min(best[name], asyncio.run(run_served(server.base_url, jobs, warmup))[0])
            server.admin("kvmanager", "clear")
    stop_server(both["off"])
    for name, seconds in best.items():
        print(f"batch invariance {name:<4} {out_tokens / seconds:>9.1f} out tok/s")
    print(f"on / off throughput: {best['off'] / best['on']:.3f}")


# ---------------------------------------------------------------------------- section: concurrency
class RunningPoller:
    """Polls the scheduler's ``num_running`` every 50 ms in a thread and keeps the largest."""

    def __init__(self, server: Server):
        self.server = server
        self.max_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.max_seen = max(self.max_seen, self.server.admin("scheduler", "stats")["num_running"])
            self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def kv_held_and_reserved(jobs: list[Job], block_size: int, max_model_len: int) -> tuple[int, int, int]:
    """Summed over the workload: the tokens each request's KV holds at its longest (prompt + output),
    what whole blocks reserve for them (paged), and what preallocation at max_model_len reserves."""
    held = [len(p) + n for p, n in jobs]
    paged = sum(-(-h // block_size) * block_size for h in held)
    return sum(held), paged, max_model_len * len(jobs)


def section_concurrency(args, path: str, jobs: list[Job], warmup: list[int], servers: Servers) -> None:
    from transformers import AutoConfig

    block_size = RuntimeConfig().block_size
    budget_tokens = args.budget_kv_blocks * block_size
    print(f"\n== concurrency in a KV budget of {args.budget_kv_blocks} blocks x {block_size} = {budget_tokens} tokens")
    server = servers.get(*common_flags(args, args.budget_kv_blocks, args.max_num_batched_tokens))
    before = server.admin("scheduler", "stats")
    with RunningPoller(server) as poller:
        served_s, _ = asyncio.run(run_served(server.base_url, jobs, warmup))
    after = server.admin("scheduler", "stats")
    peak = after.get("max_num_running")
    source = "the scheduler's max_num_running"
    if peak is None:
        peak, source = poller.max_seen, "num_running polled every 50 ms (the scheduler has no max_num_running)"
    contiguous = budget_tokens // args.max_model_len
    model_len = AutoConfig.from_pretrained(path).max_position_embeddings
    print(f"paged (folio): peak {peak} requests running at once ({source}; polling saw {poller.max_seen}), "
          f"{after['num_preemptions'] - before['num_preemptions']} preemptions, {served_s:.1f} s")
    print(f"contiguous at max_model_len {args.max_model_len} (the server's --max-model-len): "
          f"{contiguous} at once (at the model's {model_len}: {budget_tokens // model_len})")
    ratio = f"{peak / contiguous:.1f}x" if contiguous else "inf (contiguous fits none)"
    print(f"paged / contiguous concurrency: {ratio}")
    held, paged, contig = kv_held_and_reserved(jobs, block_size, args.max_model_len)
    print(f"KV held / reserved for this workload: paged {held}/{paged} = {held / paged:.3f} "
          f"(waste {100 * (1 - held / paged):.1f}%), contiguous {held}/{contig} = {held / contig:.3f} "
          f"(waste {100 * (1 - held / contig):.1f}%)")


# ---------------------------------------------------------------------------- section: itl
async def itl_under_long_prompt(base_url: str, streams: list[list[int]], long_prompt: list[int],
                                warmup_long: list[int], max_tokens: int) -> dict:
    """Decoding streams, then one long prompt once each stream has a few tokens; the streams' gaps
    that overlap [long sent, long done + margin]."""
    async with http_session() as session:
        await one_stream(session, base_url, streams[0][:8], 4)
        await one_completion(session, base_url, warmup_long, 1)
        stamps: list[list[float]] = [[] for _ in streams]
        tasks = [asyncio.create_task(one_stream(session, base_url, p, max_tokens, s)) for p, s in zip(streams, stamps)]
        while min(map(len, stamps)) < 4:
            await asyncio.sleep(0.005)
        t_sent = time.perf_counter()
        await one_completion(session, base_url, long_prompt, 1)
        t_done = time.perf_counter()
        await asyncio.gather(*tasks)
    end = t_done + ITL_WINDOW_MARGIN_S
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b >= t_sent and a <= end]
    return {"gaps": gaps, "long_s": t_done - t_sent, "num_outlived": sum(s[-1] > end for s in stamps)}


def print_itl(name: str, r: dict) -> None:
    g = r["gaps"]
    print(f"{name:<24} ITL p50 {ms(pct(g, .5))}  p99 {ms(pct(g, .99))}  max gap {ms(max(g))}  "
          f"({len(g)} gaps; long prompt done in {r['long_s']:.2f} s)")
    if r["num_outlived"] < ITL_NUM_STREAMS:
        print(f"  warning: only {r['num_outlived']} of {ITL_NUM_STREAMS} streams outlived the window; "
              "raise --itl-max-tokens")


def section_itl(args, tokenizer, servers: Servers) -> None:
    rng = random.Random(args.seed + 1)
    streams = [random_prompt(tokenizer, rng, 32) for _ in range(ITL_NUM_STREAMS)]
    long_prompt = random_prompt(tokenizer, rng, args.itl_long_prompt)
    warmup_long = random_prompt(tokenizer, rng, args.itl_long_prompt)
    print(f"\n== ITL of {ITL_NUM_STREAMS} streams (prompt 32, max_tokens {args.itl_max_tokens}) while a "
          f"{args.itl_long_prompt}-token prompt arrives; step budget {args.itl_chunk_tokens} tokens")
    runs = {}
    flags = common_flags(args, args.num_kv_blocks, args.itl_chunk_tokens)
    for name, extra in (("chunked prefill", []), ("no chunked prefill", ["--no-enable-chunked-prefill"])):
        try:
            server = servers.get(*flags, *extra)
        except RuntimeError as exc:
            print(f"{name:<24} skipped: {exc}")
            continue
        runs[name] = asyncio.run(itl_under_long_prompt(server.base_url, streams, long_prompt, warmup_long,
                                                       args.itl_max_tokens))
        print_itl(name, runs[name])
    if len(runs) == 2:
        on, off = runs["chunked prefill"], runs["no chunked prefill"]
        print(f"no chunking / chunked: ITL p99 {pct(off['gaps'], .99) / pct(on['gaps'], .99):.2f}x, "
              f"max gap {max(off['gaps']) / max(on['gaps']):.2f}x, "
              f"long prompt latency {off['long_s'] / on['long_s']:.2f}x")


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="all", help=f"all, or a comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--quantization", default="none",
                        help="folio's weights (none: fp32, as transformers runs; auto: the model's own, int4 for the default)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="KV pool of the throughput and itl servers")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="step budget of the throughput and concurrency servers")
    parser.add_argument("--max-model-len", type=int, default=2048, help="every server's; the contiguous baseline's")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="transformers static batch size")
    parser.add_argument("--repeats", type=int, default=3,
                        help="throughput: rounds of in-process, served sync and served async; the fastest counts")
    parser.add_argument("--request-seeds", action=argparse.BooleanOptionalAction, default=True,
                        help="sampling: also run with a seed on every sampled request (--seed + its index)")
    parser.add_argument("--budget-kv-blocks", type=int, default=128, help="KV pool of the concurrency server")
    parser.add_argument("--itl-chunk-tokens", type=int, default=256, help="step budget of both itl servers")
    parser.add_argument("--itl-long-prompt", type=int, default=2000, help="tokens of the long prompt")
    parser.add_argument("--itl-max-tokens", type=int, default=96, help="tokens each decoding stream generates")
    args = parser.parse_args(argv)
    chosen = set(SECTIONS) if args.sections == "all" else set(args.sections.split(","))
    if chosen - set(SECTIONS):
        parser.error(f"unknown sections: {', '.join(sorted(chosen - set(SECTIONS)))}")
    args.sections = tuple(name for name in SECTIONS if name in chosen)
    if args.itl_long_prompt + 1 > args.max_model_len:
        parser.error("--max-model-len must hold the long prompt and its one output token")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    jobs = workload(tokenizer, args.num_requests, args.seed)
    warmup = random_prompt(tokenizer, random.Random(args.seed + 2), 24)
    print(f"model {Path(path).name}, folio's weights --quantization {args.quantization} (transformers float32), "
          f"{torch.get_num_threads()} torch threads, "
          f"{os.cpu_count()} CPUs; sections: {', '.join(args.sections)}")
    print(f"workload (throughput, concurrency): {describe(jobs)}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    servers = Servers(path)
    meter, total = CpuMeter(), CpuMeter()
    runners = {"throughput": lambda: section_throughput(args, path, jobs, warmup, pad_id, servers),
               "itl": lambda: section_itl(args, tokenizer, servers),
               "sampling": lambda: section_sampling(args, jobs, warmup, servers),
               "invariance": lambda: section_invariance(args, jobs, warmup, servers),
               "concurrency": lambda: section_concurrency(args, path, jobs, warmup, servers)}
    try:
        for name in SECTIONS:
            if name in args.sections:
                runners[name]()
                print(f"({name}: {meter.lap()})")
    finally:
        servers.close()
    print(f"\n(all: {total.lap()}; {Servers.num_started_total} server starts)")


if __name__ == "__main__":
    main()

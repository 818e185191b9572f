"""folio against llama.cpp's own server on the CPU, on the same GGUF: single stream, a mixed workload, the memory roofline.

    folio bench cpu-vs-llamacpp [--shapes smollm2 1b] [--threads 2] [--runs 3]

More in docs/modules.md (folio/bench/cpu_vs_llamacpp.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from folio.bench.cpu_meter import CpuMeter

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has had "
         "not but one their they its first also new after who two been other when more time she there all into year "
         "some would than most over about world only can out up during school while people city made under used well "
         "between both may later part where three many before state being then found however such through area same "
         "known work since became film war team called around including until them each like life four high second "
         "back best several north south east west small large long last him any").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_bandwidth(threads: int) -> float:
    """GB/s read+written by a 256 MB copy and read by a sum, best of 5 (torch, ``threads``)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(64 * 1024 * 1024)  # 256 MB
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        t1 = time.perf_counter()
        a.sum()
        t2 = time.perf_counter()
        best = max(best, 2 * a.nbytes / (t1 - t0) / 1e9, a.nbytes / (t2 - t1) / 1e9)
    return best


def weight_bytes_per_token(gguf_path: str) -> int:
    """The bytes of weights one decode step reads: every tensor, less the embedding table when the
    LM head has its own (a token's embedding is one row)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    return total - sizes.get("token_embd.weight", 0) if "output.weight" in sizes else total


def shape_model(shape: str) -> tuple[str, str]:
    """(what folio serves, the GGUF llama.cpp serves) for a shape."""
    if shape == "smollm2":
        from folio.core.model_files import packaged_gguf

        return "SmolLM2-135M-Instruct", str(packaged_gguf())
    if shape == "1b":
        from folio.testing.gguf_models import llama_1b_gguf

        path = str(llama_1b_gguf("Q4_1"))
        return path, path
    raise SystemExit(f"unknown shape {shape!r}: smollm2 or 1b")


class ComparedServer:
    def __init__(self, name: str, command: list[str], port: int, env: dict, log: Path):
        self.name, self.port, self.log = name, port, log
        self.proc = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, path: str, timeout_s: float = 900.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready in {timeout_s} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def complete(session, port: int, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data}")
        return int(data["usage"]["completion_tokens"])


async def single_stream(port: int, model: str, tokens: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        n = await complete(session, port, model, "Write a long story about a lighthouse keeper.", tokens)
        return n / (time.perf_counter() - t0)


def mixed_requests(seed: int = 0, num: int = 48) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 160))), rng.randint(8, 80))
            for _ in range(num)]


async def mixed(port: int, model: str, requests: list[tuple[str, int]], concurrency: int) -> float:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        async def one(prompt: str, max_tokens: int) -> int:
            async with gate:
                return await complete(session, port, model, prompt, max_tokens)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p, m) for p, m in requests))
        return sum(done) / (time.perf_counter() - t0)


def in_process(model: str, tokens: int, runs: int) -> float:
    """folio.LLM's single-stream tokens a second, best of ``runs``, in a child process (its memory
    goes with it)."""
    code = (
        "import time\nfrom folio import LLM, SamplingParams\n"
        f"llm = LLM(model={model!r}, num_kv_blocks=256)\n"
        f"p = SamplingParams(temperature=0, max_tokens={tokens}, ignore_eos=True)\n"
        "llm.generate(['Hello'], p, use_tqdm=False)\nbest = 0.0\n"
        f"for _ in range({runs}):\n"
        "    t = time.perf_counter(); o = llm.generate(['Write a long story about a lighthouse keeper.'], p, "
        "use_tqdm=False)\n"
        "    best = max(best, len(o[0].outputs[0].token_ids) / (time.perf_counter() - t))\n"
        "print('RESULT', best)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(next(line for line in out.splitlines() if line.startswith("RESULT")).split()[1])


def bench_shape(shape: str, args, binary: str, bandwidth: float, meter: CpuMeter) -> dict:
    from folio.testing.llamacpp import server_command

    folio_model, gguf_path = shape_model(shape)
    per_token = weight_bytes_per_token(gguf_path)
    tmp = Path(tempfile.mkdtemp(prefix="folio-vs-llama-"))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    fport, lport = free_port(), free_port()
    servers = {
        "folio": ComparedServer("folio serve", [sys.executable, "-m", "folio.cli.main", "serve", "--model", folio_model,
                                        "--port", str(fport)], fport, env, tmp / "folio.log"),
        "llama.cpp": ComparedServer("llama-server", server_command(binary, gguf_path, lport, args.concurrency)
                            + ["-t", str(args.threads), "-tb", str(args.threads)], lport, env, tmp / "llama.log"),
    }
    ports = {"folio": fport, "llama.cpp": lport}
    names = {"folio": folio_model, "llama.cpp": "model"}
    try:
        servers["folio"].wait_ready("/health")
        servers["llama.cpp"].wait_ready("/health")
        requests = mixed_requests(args.seed, args.requests)
        result: dict = {"shape": shape, "bytes_per_token": per_token}
        meter.share()
        for side in ("folio", "llama.cpp"):  # the first mixed run after start, cold
            result[f"{side} mixed first"] = asyncio.run(mixed(ports[side], names[side], requests, args.concurrency))
        for side in ("folio", "llama.cpp"):
            result[f"{side} single"] = 0.0
            result[f"{side} mixed"] = []
        for _ in range(args.runs):
            for side in ("folio", "llama.cpp"):  # alternating
                result[f"{side} single"] = max(result[f"{side} single"],
                                               asyncio.run(single_stream(ports[side], names[side], args.tokens)))
        for _ in range(args.mixed_runs):
            for side in ("folio", "llama.cpp"):
                result[f"{side} mixed"].append(asyncio.run(mixed(ports[side], names[side], requests,
                                                                 args.concurrency)))
        result["others"] = meter.share()[1]
    finally:
        for s in servers.values():
            s.stop()
    result["folio in-process"] = in_process(folio_model, args.tokens, args.runs)
    result["roofline tok/s"] = bandwidth * 1e9 / per_token
    return result


def report(r: dict, bandwidth: float) -> None:
    s = r["shape"]
    fs, ls = r["folio single"], r["llama.cpp single"]
    fm, lm = max(r["folio mixed"]), max(r["llama.cpp mixed"])
    roof = r["roofline tok/s"]
    print(f"{s} weight bytes per token: {r['bytes_per_token'] / 1e6:.1f} MB")
    print(f"{s} roofline: {roof:.0f} tok/s")
    print(f"{s} folio single stream: {fs:.1f} tok/s")
    print(f"{s} llama.cpp single stream: {ls:.1f} tok/s")
    print(f"{s} single stream ratio: {fs / ls:.2f} x")
    print(f"{s} folio mixed: {fm:.1f} tok/s")
    print(f"{s} llama.cpp mixed: {lm:.1f} tok/s")
    print(f"{s} mixed ratio: {fm / lm:.2f} x")
    print(f"{s} mixed first run ratio: {r['folio mixed first'] / r['llama.cpp mixed first']:.2f} x")
    print(f"{s} folio in-process single stream: {r['folio in-process']:.1f} tok/s")
    print(f"{s} folio served / in-process: {fs / r['folio in-process']:.2f} x")
    print(f"{s} folio in-process roofline share: {100 * r['folio in-process'] / roof:.1f} %")
    print(f"{s} llama.cpp served roofline share: {100 * ls / roof:.1f} %")
    print()
    print(f"| {s} | folio | llama.cpp | ratio |")
    print("|---|---|---|---|")
    print(f"| single stream, {r['tokens']} tokens, best of {r['runs']} | {fs:.1f} tok/s | {ls:.1f} | {fs / ls:.2f}x |")
    print(f"| mixed, {r['requests']} requests, {r['concurrency']} at once, warm (each run) | "
          f"{', '.join(f'{v:.1f}' for v in r['folio mixed'])} | {', '.join(f'{v:.1f}' for v in r['llama.cpp mixed'])}"
          f" | {fm / lm:.2f}x |")
    print(f"| the same, first run after start | {r['folio mixed first']:.1f} | {r['llama.cpp mixed first']:.1f} | "
          f"{r['folio mixed first'] / r['llama.cpp mixed first']:.2f}x |")
    print(f"| roofline ({bandwidth:.1f} GB/s / {r['bytes_per_token'] / 1e6:.1f} MB a token) | "
          f"in process {100 * r['folio in-process'] / roof:.0f}% | served {100 * ls / roof:.0f}% | |")
    print(f"other processes took {100 * r['others']:.0f}% of the CPU meanwhile")
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="folio bench cpu-vs-llamacpp", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["smollm2", "1b"], choices=["smollm2", "1b"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--runs", type=int, default=3, help="single-stream runs per server (the best counts)")
    p.add_argument("--mixed-runs", type=int, default=2, help="warm mixed runs per server")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from folio.testing.llamacpp import build_llama_cpp, find_llama_server

    binary = find_llama_server()
    if binary is None:
        print("building llama-server from the llama-cpp-python sources (minutes, once)", file=sys.stderr)
        build_llama_cpp(jobs=args.threads)
        binary = find_llama_server()
    meter = CpuMeter()
    bandwidth = measure_bandwidth(args.threads)
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}")
    print(f"memory bandwidth: {bandwidth:.1f} GB/s")
    for shape in args.shapes:
        r = bench_shape(shape, args, binary, bandwidth, meter)
        r.update(tokens=args.tokens, runs=args.runs, requests=args.requests, concurrency=args.concurrency)
        report(r, bandwidth)
    return 0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "unknown CPU"
    isa = "AMX" if "amx_tile" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa})"


if __name__ == "__main__":
    sys.exit(main())

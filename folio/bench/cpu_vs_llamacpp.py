"""folio against the best CPU engines (llama.cpp, ik_llama.cpp), each at its best flags, on the same GGUF files.

    folio bench cpu-vs-llamacpp [--quick] [--shapes smollm2 1b 3b] [--types Q4_0 Q4_K_M Q8_0] [--threads N]

The engines' configurations, the rounds of servers (one at a time, cold then warm, alternating),
the quality step and the report. The KLDs of the engines are comparable because all but the
engine is shared: one reference (mainline ``llama-perplexity`` on the shape's BF16 file), its
tokens, chunks and scored positions, one 16-bit encoding of every engine's log-probabilities and
one KL function over them (``peer_quality``); the ``BF16 floor`` lines show the part of a figure
that is arithmetic, not quantization.

More in docs/modules.md (folio/bench/cpu_vs_llamacpp.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from folio.bench import peer_quality as pq
from folio.bench import peer_runs as pr
from folio.bench.cpu_meter import CpuMeter

# the workload, full and --quick; a flag given on the command line wins over either
FULL = dict(shapes=["smollm2", "1b", "3b"], types=["Q4_0", "Q4_K_M", "Q8_0"], tokens=128, runs=3, mixed_runs=1,
            requests=48, concurrency=32, ctx_per_slot=2048, prompt_tokens=2000, ttft_runs=2, rounds=2,
            quality_tokens=10240, quality_ctx=512)
QUICK = dict(FULL, shapes=["smollm2"], types=["Q4_0"], tokens=32, runs=1, requests=8, concurrency=8,
             ctx_per_slot=1024, prompt_tokens=512, ttft_runs=1, quality_tokens=1024, quality_ctx=256)
EXTRA_TYPES = {"smollm2": ["Q4_1"]}  # the packaged file itself, with the shape's other types


@dataclass(frozen=True)
class Config:
    """An engine at one set of flags."""

    label: str  # how it is reported: "folio", "llama.cpp", "ik_llama.cpp -rtr"
    engine: str  # "folio" or a peer's name
    flags: tuple[str, ...] = ()  # for the server and llama-perplexity alike


@dataclass
class Tally:
    """One configuration's figures on one file."""

    healthy_s: list[float] = field(default_factory=list)  # by round
    single: list[float] = field(default_factory=list)
    mixed: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    peak_rss: int = 0
    peak_pss: int = 0
    quality: dict | None = None
    floor: dict | None = None
    notes: list[str] = field(default_factory=list)


def configurations(args) -> list[Config]:
    out = [Config("folio", "folio")]
    if "llama.cpp" in args.peers:
        out.append(Config("llama.cpp", "llama.cpp"))
    if "ik_llama.cpp" in args.peers:
        flags = tuple(args.ik_flags.split())
        if args.ik_rtr in ("off", "auto"):
            out.append(Config("ik_llama.cpp", "ik_llama.cpp", flags))
        if args.ik_rtr in ("on", "auto"):
            out.append(Config("ik_llama.cpp -rtr", "ik_llama.cpp", flags + ("-rtr",)))
    return out


def folio_block_size() -> int:
    from folio.shared.config import RuntimeConfig

    return RuntimeConfig.__dataclass_fields__["block_size"].default


def server_argv(config: Config, gguf: Path, port: int, args, binaries: dict) -> tuple[list[str], str]:
    """(the command, the model name its requests carry) for ``config`` serving ``gguf``."""
    if config.engine == "folio":
        blocks = -(-args.concurrency * args.ctx_per_slot // folio_block_size())
        return [sys.executable, "-m", "folio.cli.main", "serve", "--model", str(gguf), "--port", str(port),
                "--max-num-seqs", str(args.concurrency), "--max-model-len", str(args.ctx_per_slot),
                "--num-kv-blocks", str(blocks)], str(gguf)
    from folio.testing.llamacpp import PEERS, server_command

    peer = PEERS[config.engine]
    # -cram 0: no host-memory copy of idle slots' KV (the workloads never reuse it; it would count as memory)
    argv = server_command(binaries[config.engine]["llama-server"], str(gguf), port, args.concurrency,
                          args.ctx_per_slot, peer) + ["-t", str(args.threads), "-tb", str(args.threads), "-cram", "0"]
    return argv + list(config.flags), "model"


def run_session(config: Config, gguf: Path, cold: bool, args, ctx: dict, tally: Tally, prompts: list) -> None:
    """Start ``config`` on ``gguf`` (cold or warm), run the workloads, stop it, add to ``tally``."""
    if cold:
        pr.evict_page_cache(gguf)
        if config.engine == "folio":
            ctx["folio_cache"].empty()
    share = pr.page_cache_share(gguf)
    port = pr.free_port()
    argv, model = server_argv(config, gguf, port, args, ctx["binaries"])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **ctx["folio_cache"].env())
    log = ctx["workdir"] / f"{config.label.replace(' ', '')}-{len(tally.healthy_s)}.log"
    server = pr.MeasuredServer(config.label, argv, port, env, log)
    try:
        tally.healthy_s.append(server.wait_healthy())
        for _ in range(args.runs):
            tally.single.append(pr.single_stream(port, model, args.tokens))
        for prompt in prompts:
            tally.ttft_s.append(pr.first_token_s(port, model, prompt))
        for _ in range(args.mixed_runs):
            tally.mixed.append(pr.mixed(port, model, ctx["requests"], args.concurrency))
    except Exception as exc:  # the server's own words say why (its log goes with the run's folder)
        raise RuntimeError(f"{config.label} on {gguf.name}: {exc!r}; its log ends:\n{log.read_text()[-3000:]}") from exc
    finally:
        server.stop()
    tally.peak_rss = max(tally.peak_rss, server.memory.peak_rss)
    tally.peak_pss = max(tally.peak_pss, server.memory.peak_pss)
    startup = [line for line in log.read_text().splitlines() if "start-up" in line and "healthy" in line]
    kind = "cold" if cold else "warm"
    tally.notes.append(f"{config.label} {kind} start: {100 * share:.0f}% of the file in the page cache"
                       + (f"; {startup[-1].strip()}" if startup else ""))


def in_process(gguf: Path, tokens: int, runs: int, env: dict) -> float:
    """folio.LLM's single-stream tokens a second, best of ``runs``, in a child process."""
    code = (
        "import sys, time\nfrom folio import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], num_kv_blocks=256)\n"
        f"p = SamplingParams(temperature=0, max_tokens={tokens}, ignore_eos=True)\n"
        "llm.generate(['Hello'], p, use_tqdm=False)\nbest = 0.0\n"
        f"for _ in range({runs}):\n"
        f"    t = time.perf_counter(); o = llm.generate([{pr.STORY!r}], p, use_tqdm=False)\n"
        "    best = max(best, len(o[0].outputs[0].token_ids) / (time.perf_counter() - t))\n"
        "print('RESULT', best)\n")
    out = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"folio.LLM on {gguf} failed:\n{out.stderr[-3000:]}")
    return float(next(line for line in out.stdout.splitlines() if line.startswith("RESULT")).split()[1])


def quality(shape: str, gguf: Path, args, ctx: dict, tallies: dict[str, Tally]) -> None:
    """Each configuration's KLD on ``gguf`` from the shape's BF16 reference, and on the BF16 file itself."""
    from folio.testing.gguf_models import bench_gguf
    from folio.testing.llamacpp import LLAMA_CPP

    bf16 = bench_gguf(shape, "BF16")
    text = ctx["workdir"].parent / "gate.txt"  # once a run: eval_quant keeps the samples it decodes
    if not text.is_file():
        pq.write_gate_text(text, args.quality_tokens, dict(os.environ))
    key = hashlib.sha256(f"{bf16.name} {text.read_text()} {args.quality_ctx} {LLAMA_CPP.pin}".encode()).hexdigest()
    reference = ctx["root"] / "quality" / f"reference-{shape}-{key[:16]}.dat"
    if not reference.is_file():
        reference.parent.mkdir(parents=True, exist_ok=True)
        partial = reference.with_suffix(".partial")
        pq.perplexity_dump(ctx["binaries"]["llama.cpp"]["llama-perplexity"], bf16, text, partial, args.quality_ctx,
                           args.threads, log=ctx["workdir"] / "reference.log")
        partial.replace(reference)
    ref = pq.read_dump(reference)
    floors = ctx.setdefault("floors", {})  # by (reference, configuration): one per shape
    for config in ctx["configs"]:
        tally = tallies[config.label]
        tally.quality = score(config, gguf, text, reference, ref, args, ctx)
        if config.engine != "llama.cpp":  # mainline's floor is its own reference: zero
            if (reference, config) not in floors:
                floors[reference, config] = score(config, bf16, text, reference, ref, args, ctx)
            tally.floor = floors[reference, config]


def score(config: Config, model: Path, text: Path, reference: Path, ref, args, ctx: dict) -> dict:
    dump = ctx["workdir"] / f"{config.label.replace(' ', '')}-{model.stem[-12:]}.dat"
    log = dump.with_suffix(".log")
    if config.engine == "folio":
        pq.folio_dump(model, reference, dump, dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                                                   **ctx["folio_cache"].env()), log)
    else:
        pq.perplexity_dump(ctx["binaries"][config.engine]["llama-perplexity"], model, text, dump, args.quality_ctx,
                           args.threads, config.flags, log)
    try:
        return pq.kld(ref, pq.read_dump(dump))
    finally:
        dump.unlink(missing_ok=True)


def bench_file(shape: str, qtype: str, args, ctx: dict) -> dict[str, Tally]:
    """Every configuration on one file: the rounds of servers, folio in process, quality."""
    from folio.testing.gguf_models import bench_gguf

    gguf = bench_gguf(shape, qtype)
    configs = ctx["configs"]
    tallies = {c.label: Tally() for c in configs}
    prompts = pr.long_prompts(args.rounds * args.ttft_runs, args.prompt_tokens, seed=args.seed)
    ctx["meter"].share()
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]  # alternating, each first in turn
        for config in order:
            print(f"- {shape} {qtype}: round {r + 1} of {args.rounds}, {config.label}", file=sys.stderr, flush=True)
            mine = prompts[r * args.ttft_runs:(r + 1) * args.ttft_runs]
            run_session(config, gguf, r == 0, args, ctx, tallies[config.label], mine)
    others = ctx["meter"].share()[1]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **ctx["folio_cache"].env())
    folio_in_process = in_process(gguf, args.tokens, args.runs, env)
    if args.quality_tokens > 0:
        quality(shape, gguf, args, ctx, tallies)
    report(f"{shape} {qtype}", gguf, tallies, args, (ctx["bandwidth"], folio_in_process, others))
    return tallies


class Measure(NamedTuple):
    name: str
    unit: str
    figure: Callable[[Tally], float | None]  # a configuration's runs -> its figure
    higher: bool  # whether higher is better
    decimals: int  # -1: scientific
    compared: bool = True  # whether folio gets a ratio against the best peer


MEASURES = [
    Measure("single stream", "tok/s", lambda t: max(t.single, default=None), True, 1),
    Measure("mixed", "tok/s", lambda t: max(t.mixed, default=None), True, 1),
    Measure("time to first token", "s", lambda t: min(t.ttft_s, default=None), False, 3),
    Measure("seconds to healthy cold", "s", lambda t: t.healthy_s[0] if t.healthy_s else None, False, 2),
    Measure("seconds to healthy warm", "s", lambda t: min(t.healthy_s[1:], default=None), False, 2),
    Measure("peak resident memory", "MB", lambda t: t.peak_rss / 1e6 or None, False, 1),
    Measure("peak proportional memory", "MB", lambda t: t.peak_pss / 1e6 or None, False, 1),
    Measure("KLD", "", lambda t: t.quality["kld"] if t.quality else None, False, -1),
    Measure("top-1 agreement", "%", lambda t: 100 * t.quality["top1"] if t.quality else None, True, 2),
    # each engine's arithmetic against mainline's: context for the KLD, not a contest
    Measure("BF16 floor KLD", "", lambda t: t.floor["kld"] if t.floor else None, False, -1, compared=False),
]
# the runs behind the figures, printed as notes: (measure, Tally attribute, unit, decimals)
RUNS = [("single stream", "single", "tok/s", 1), ("mixed", "mixed", "tok/s", 1),
        ("time to first token", "ttft_s", "s", 3), ("seconds to healthy", "healthy_s", "s", 2)]


def fmt(value: float, decimals: int) -> str:
    return f"{value:.3e}" if decimals < 0 else f"{value:.{decimals}f}"


def compare(values: dict[str, float], higher: bool) -> tuple[str, float] | None:
    """(the best peer configuration, folio against it: above 1 when folio is better)."""
    peers = {k: v for k, v in values.items() if k != "folio" and v is not None}
    if not peers or values.get("folio") is None:
        return None
    best = (max if higher else min)(peers, key=peers.get)
    folio, peer = values["folio"], peers[best]
    if 0 in (folio, peer):
        return best, float("nan")
    return best, folio / peer if higher else peer / folio


def report(name: str, gguf: Path, tallies: dict[str, Tally], args, machine: tuple[float, float, float]) -> None:
    """Every figure of one file; ``machine``: (the bandwidth in GB/s, folio's in-process tokens a
    second, the share of the CPU other processes took)."""
    bandwidth, folio_in_process, others = machine
    per_token = weight_bytes_per_token(str(gguf))
    roof = bandwidth * 1e9 / per_token
    print(f"{name} file size: {gguf.stat().st_size / 1e6:.1f} MB")
    print(f"{name} weight bytes per token: {per_token / 1e6:.1f} MB")
    print(f"{name} roofline: {roof:.1f} tok/s")
    rows = []
    for m in MEASURES:
        values = {label: m.figure(t) for label, t in tallies.items()}
        if all(v is None for v in values.values()):
            continue
        for label, value in values.items():
            if value is not None:
                print(f"{name} {m.name} {label}: {fmt(value, m.decimals)} {m.unit}".rstrip())
        verdict = compare(values, m.higher) if m.compared else None
        if verdict is not None:
            print(f"{name} {m.name} folio vs best peer: {verdict[1]:.2f} x")
            print(f"- {name} {m.name}: the best peer is {verdict[0]}")
        rows.append((m, values, verdict))
    folio = tallies["folio"]
    served = max(folio.single, default=0.0)
    print(f"{name} folio in-process single stream: {folio_in_process:.1f} tok/s")
    if served:
        print(f"{name} folio served / in-process: {served / folio_in_process:.2f} x")
    print(f"{name} folio in-process roofline share: {100 * folio_in_process / roof:.1f} %")
    peers = [max(t.single) for label, t in tallies.items() if label != "folio" and t.single]
    if peers:
        print(f"{name} best peer served roofline share: {100 * max(peers) / roof:.1f} %")
    print(f"{name} other processes' CPU share: {100 * others:.0f} %")
    for t in tallies.values():
        for note in t.notes:
            print(f"- {name} {note}")
    for measure, attribute, unit, decimals in RUNS:
        for label, t in tallies.items():
            print(f"- {name} {measure}, each run in order, {label}: "
                  f"{', '.join(fmt(v, decimals) for v in getattr(t, attribute))} {unit}")
    table(name, tallies, rows, args)


def table(name: str, tallies: dict[str, Tally], rows: list, args) -> None:
    labels = list(tallies)
    n = args.rounds
    what = {"single stream": f"single stream, {args.tokens} tokens, best of {args.runs * n}",
            "mixed": f"mixed, {args.requests} requests, {args.concurrency} at once, best of {args.mixed_runs * n}",
            "time to first token": f"time to first token, {args.prompt_tokens}-token prompt, best of "
                                   f"{args.ttft_runs * n}"}
    print()
    print(f"| {name} | {' | '.join(labels)} | folio vs best peer |")
    print("|---" * (len(labels) + 2) + "|")
    for m, values, verdict in rows:
        cells = [fmt(values[label], m.decimals) if values[label] is not None else "—" for label in labels]
        ratio = f"{verdict[1]:.2f}x ({verdict[0]})" if verdict else ""
        print(f"| {what.get(m.name, m.name)} ({m.unit or 'nats'}) | {' | '.join(cells)} | {ratio} |")
    print()


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


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="folio bench cpu-vs-llamacpp", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="SmolLM2 Q4_0 only, fewer tokens and requests (a smoke)")
    p.add_argument("--shapes", nargs="+", choices=["smollm2", "1b", "3b"])
    p.add_argument("--types", nargs="+", help="llama-quantize types (default Q4_0 Q4_K_M Q8_0; SmolLM2 adds Q4_1)")
    p.add_argument("--peers", nargs="+", default=["llama.cpp", "ik_llama.cpp"], choices=["llama.cpp", "ik_llama.cpp"])
    p.add_argument("--ik-rtr", choices=["auto", "on", "off"], default="auto",
                   help="ik_llama.cpp's run-time repacking: auto runs it with and without, the better counts")
    # its flash-attention kernels abort (GGML_ASSERT(S > 0) in iqk_fa_templates.h) when a slot that
    # served one prompt is given another: the mixed workload does that at once
    p.add_argument("--ik-flags", default="-no-fa", help="flags every ik_llama.cpp run gets (default: -no-fa)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, help="server starts per configuration (the first cold), alternating")
    p.add_argument("--runs", type=int, help="single-stream runs per start (the best counts)")
    p.add_argument("--tokens", type=int, help="tokens of a single stream")
    p.add_argument("--mixed-runs", type=int, help="mixed-workload runs per start")
    p.add_argument("--requests", type=int, help="requests of the mixed workload")
    p.add_argument("--concurrency", type=int, help="requests at once, and every server's slots")
    p.add_argument("--ctx-per-slot", type=int, help="context per slot (folio: --max-model-len)")
    p.add_argument("--prompt-tokens", type=int, help="the time-to-first-token prompt's length")
    p.add_argument("--ttft-runs", type=int, help="time-to-first-token prompts per start (each new)")
    p.add_argument("--quality-tokens", type=int, help="tokens of the quality gate's text (0: no quality)")
    p.add_argument("--quality-ctx", type=int, help="llama-perplexity's chunk (-c)")
    p.add_argument("--jobs", type=int, default=2, help="compile jobs when a peer must be built")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    extra = not args.quick and args.types is None
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.types_of = {s: args.types + (EXTRA_TYPES.get(s, []) if extra else []) for s in args.shapes}
    if args.prompt_tokens + 1 > args.ctx_per_slot:
        p.error(f"--prompt-tokens {args.prompt_tokens} does not fit --ctx-per-slot {args.ctx_per_slot}")
    if args.rounds < 1 or args.quality_tokens and args.quality_tokens < 2 * args.quality_ctx:
        p.error("--rounds must be at least 1, --quality-tokens 0 or at least twice --quality-ctx")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from folio.shared.config import cache_dir
    from folio.testing.llamacpp import PEERS, ensure_peer

    binaries = {name: ensure_peer(PEERS[name], jobs=args.jobs) for name in ["llama.cpp", *args.peers]}
    root = cache_dir() / "bench-cpu-vs-llamacpp"
    ctx = {"binaries": binaries, "root": root, "configs": configurations(args), "meter": CpuMeter(),
           "folio_cache": pr.FolioCache(root / "folio-cache", cache_dir()),
           "requests": pr.mixed_requests(args.seed, args.requests)}
    ctx["bandwidth"] = measure_bandwidth(args.threads)
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}; {args.threads} threads per engine")
    print(f"memory bandwidth: {ctx['bandwidth']:.1f} GB/s")
    print(f"- peers: {', '.join(c.label for c in ctx['configs'] if c.engine != 'folio')}; "
          f"{args.concurrency} slots of {args.ctx_per_slot} tokens each; ik_llama.cpp always with {args.ik_flags!r}")
    with tempfile.TemporaryDirectory(prefix="folio-vs-peers-", dir=root) as run_dir:  # logs, text, dumps
        for shape in args.shapes:
            for qtype in args.types_of[shape]:
                ctx["workdir"] = Path(run_dir) / f"{shape}-{qtype}"
                ctx["workdir"].mkdir()
                bench_file(shape, qtype, args, ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())

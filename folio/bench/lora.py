"""Multi-LoRA throughput: SmolLM2 (the int4 default) with 32 concurrent streams, the base model
alone against 8 distinct rank-16 adapters (every projection targeted) mixed in the same batches.

Both runs go through the real scheduler (``EngineCore``) on one runner, in turns, ``--repeats``
times; each prints tokens/s (prompt and output tokens over wall time) and the ratio of the mixed
run to the base run of the same round. Target (issue: multi-LoRA): at least 0.75x.
The adapters are random ``peft`` adapters (``folio.testing.peft_adapters``; peft is a test extra).

    python scripts/bench_lora.py [--streams 32] [--adapters 8] [--rank 16] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from folio.core.engine import EngineCore
from folio.core.executor.runtime.runner import ModelRunner
from folio.core.model_files import prepare_default_model
from folio.shared.config import RuntimeConfig
from folio.shared.messages import EngineRequest
from folio.shared.sampling import SamplingParams
from folio.testing.peft_adapters import write_peft_adapter
from folio.bench.cpu_meter import CpuMeter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def throughput(runner: ModelRunner, names: list[str | None], streams: int, prompt_len: int, new_tokens: int,
               tag: str) -> float:
    """Tokens/s of ``streams`` requests (request i on adapter ``names[i % len(names)]``)."""
    core = EngineCore(runner, max_num_seqs=streams, max_num_batched_tokens=2048, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(streams):
        prompt = [(31 * i + 7 * j) % 40000 + 100 for j in range(prompt_len)]
        assert not core.add_request(EngineRequest(req_id=f"{tag}{i}", prompt_token_ids=prompt, sampling=params,
                                                  lora_name=names[i % len(names)]))
    start, tokens = time.perf_counter(), 0
    while core.has_work():
        batch = core.step()
        for d in batch.all_deltas() if batch else ():
            assert d.finish_reason != "error", d.error
            tokens += len(d.token_ids)
    return (streams * prompt_len + tokens) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    smol = str(prepare_default_model(quiet=True))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"a{i}": write_peft_adapter(smol, Path(tmp) / f"a{i}", args.rank, TARGETS, seed=i, std=0.02)
                    for i in range(args.adapters)}
        runner = ModelRunner(RuntimeConfig(num_kv_blocks=1024, block_size=16), smol, enable_lora=True,
                             max_loras=args.adapters, max_lora_rank=args.rank,
                             lora_modules=[f"{n}={p}" for n, p in adapters.items()])
        throughput(runner, [None, *adapters], args.streams, 16, 4, "warm")  # loads every adapter into its slot
        meter = CpuMeter()
        ratios = []
        for r in range(args.repeats):
            base = throughput(runner, [None], args.streams, args.prompt_len, args.new_tokens, f"b{r}-")
            mixed = throughput(runner, list(adapters), args.streams, args.prompt_len, args.new_tokens, f"l{r}-")
            ratios.append(mixed / base)
            print(f"round {r}: base {base:.1f} tokens/s, {args.adapters} adapters mixed {mixed:.1f} tokens/s, "
                  f"ratio {mixed / base:.2f}")
        others = meter.lap()
    print(f"SmolLM2 ({runner.stats()['quantization']}, {runner.backend.name} backend), {args.streams} streams, "
          f"{args.adapters} rank-{args.rank} adapters, {torch.get_num_threads()} torch threads")
    print(f"adapters mixed / base: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}"
          f" (target at least 0.75x)")
    print(f"measured over {others}")


if __name__ == "__main__":
    main()

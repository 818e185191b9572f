"""Decode throughput of folio's runtime, fp32 and quantized, against transformers ``generate``
(static batch), all in the same run.

For each batch size, each generates NEW tokens greedily from the same short prompts; decode time is
``time(NEW tokens) - time(1 token)`` so prefill is left out, the fastest of ``--repeats`` such pairs
(a 2-core machine's noise only ever slows a run down); the modes alternate within each repeat. Prints tokens/s of transformers, of
folio with ``--quantization none`` (fp32) and of each quantized mode with its ratio to fp32.

    python scripts/bench_runtime.py [--model PATH] [--batch-sizes 1 8 32] [--new-tokens 64]
                                    [--quantizations int4 int8]
"""

from __future__ import annotations

import argparse
import time

import torch

from folio.core.engine import generate
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import DEFAULT_MODEL_NAME, RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.core.model_files import resolve_model

WORDS = "the a river mountain city code model light quiet storm paper engine story garden".split()


def make_prompts(tokenizer, batch: int) -> list[list[int]]:
    prompts = []
    for i in range(batch):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(12))
        prompts.append(tokenizer.encode(text)[:12])
    return prompts


def time_folio(runner, prompts, new_tokens: int) -> float:
    def once(n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        generate(runner, prompts, params)
        return time.perf_counter() - t0

    return once(new_tokens) - once(1)


def time_hf(hf, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed

    def once(n):
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    once(2)
    return once(new_tokens) - once(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quantizations", nargs="+", default=["int4", "int8"],
                        help="modes timed against fp32 (--quantization none) in the same run")
    parser.add_argument("--no-transformers", action="store_true", help="leave the transformers column out")
    parser.add_argument("--repeats", type=int, default=3, help="timings per mode and batch; the fastest counts")
    args = parser.parse_args(argv)

    from folio.bench.cpu_meter import CpuMeter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meter = CpuMeter()
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = None
    if not args.no_transformers:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = tokenizer.eos_token_id
    modes = ["none", *args.quantizations]
    runners = {m: ModelRunner(RuntimeConfig(num_kv_blocks=512, quantization=m), str(path)) for m in modes}
    decoded = args.new_tokens - 1
    print(f"model={path.name} dtype=float32 threads={torch.get_num_threads()} new_tokens={args.new_tokens} "
          f"(none = fp32 weights; quantized layers take bf16 activations)")
    head = f"{'batch':>5} {'transformers':>12} {'none (fp32)':>12}" + "".join(f" {m:>16}" for m in modes[1:])
    print(head + "   tokens/s (x: against none)")
    with torch.inference_mode():
        for batch in args.batch_sizes:
            prompts = make_prompts(tokenizer, batch)
            ref = batch * decoded / time_hf(hf, prompts, args.new_tokens) if hf is not None else float("nan")
            for m in modes:  # warm-up
                time_folio(runners[m], prompts, 2)
            best = dict.fromkeys(modes, float("inf"))
            for _ in range(args.repeats):
                for m in modes:
                    best[m] = min(best[m], time_folio(runners[m], prompts, args.new_tokens))
            rates = {m: batch * decoded / best[m] for m in modes}
            row = f"{batch:>5} {ref:>12.1f} {rates['none']:>12.1f}"
            row += "".join(f" {rates[m]:>8.1f} ({rates[m] / rates['none']:.2f}x)" for m in modes[1:])
            print(row, flush=True)
    print(meter.lap())


if __name__ == "__main__":
    main()

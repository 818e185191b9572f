"""Decode throughput of folio's runtime against transformers ``generate`` (static batch), same run.

For each batch size, both generate NEW tokens greedily from the same short prompts; decode time is
``time(NEW tokens) - time(1 token)`` so prefill is left out on both sides. Prints tokens/s and the
ratio folio / transformers.

    python scripts/bench_runtime.py [--model PATH] [--batch-sizes 1 8 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from services.executor.offline import generate
from services.executor.prepare import resolve_model
from services.executor.runner import ModelRunner
from shared.config import DEFAULT_MODEL_NAME, RuntimeConfig
from shared.messages import SamplingParams

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

    once(2)  # warm-up
    return once(new_tokens) - once(1)


def time_hf(hf, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed

    def once(n):
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    once(2)
    return once(new_tokens) - once(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.pad_token_id = tokenizer.eos_token_id
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=2048), str(path))
    decoded = args.new_tokens - 1
    print(f"model={path.name} dtype=float32 threads={torch.get_num_threads()} new_tokens={args.new_tokens}")
    print(f"{'batch':>5} {'folio tok/s':>12} {'transformers tok/s':>19} {'ratio':>7}")
    with torch.inference_mode():
        for batch in args.batch_sizes:
            prompts = make_prompts(tokenizer, batch)
            folio = batch * decoded / time_folio(runner, prompts, args.new_tokens)
            ref = batch * decoded / time_hf(hf, prompts, args.new_tokens)
            print(f"{batch:>5} {folio:>12.1f} {ref:>19.1f} {folio / ref:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()

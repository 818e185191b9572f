"""The cost of structured output per decode step: a batch whose every row follows a JSON schema
against the same batch unconstrained, same run, same prompts, greedy.

Decode time per step is the median over the decode steps (the prefill step left out) of the
engine driven in-process (``folio.core.engine.generate``: the real scheduler, no sockets); the two runs
alternate, twice each, so that drifting load from other processes hits both alike. Also prints the grammar's own parts
per step at that batch size: filling the matchers' bitmasks and masking the logits.

    python scripts/bench_structured.py [--model PATH] [--batch 64] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec
import torch

from folio.bench.cpu_meter import CpuMeter
from folio.core.engine import generate
from folio.core.executor.runtime.runner import ModelRunner
from folio.core.structured.masks import apply_grammar_masks
from folio.shared.config import DEFAULT_MODEL_NAME, RuntimeConfig
from folio.core.structured.grammar import check_spec
from folio.shared.messages import GuidedSpec
from folio.shared.sampling import SamplingParams
from folio.core.model_files import resolve_model

# long enough that no row completes its structure within the measured tokens
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "notes": {"type": "array", "items": {"type": "string"}, "minItems": 40},
    "rating": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["title", "notes", "rating"]}


def decode_step_times(runner, prompts, params: SamplingParams, new_tokens: int, grammar=None) -> list[float]:
    times: list[float] = []
    execute = runner.execute

    def timed(plan):
        t0 = time.perf_counter()
        result = execute(plan)
        times.append(time.perf_counter() - t0)
        return result

    runner.execute = timed
    try:
        generate(runner, prompts, msgspec.structs.replace(params, max_tokens=new_tokens), grammar=grammar)
    finally:
        runner.execute = execute
    return times[1:]  # the first step is the prefill


def mask_parts(runner, grammar, batch: int, steps: int = 10) -> float:
    """Seconds per step of the grammar's own work at this batch: fill + mask."""
    vocab = runner.spec.vocab_size
    matchers = [runner.grammars.matcher(grammar, []) for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    t0 = time.perf_counter()
    for _ in range(steps):
        apply_grammar_masks(logits, matchers)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = resolve_model(args.model)
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=args.batch * 8), path)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    grammar = check_spec(GuidedSpec(kind="json_schema", spec=json.dumps(SCHEMA)))
    runner.grammars.prepare(grammar).result()  # the vocabulary view and the compile, before timing
    compile_s = runner.grammars.stats["grammar_compile_seconds_total"]
    text = "<|im_start|>user\nDescribe {} as JSON.<|im_end|>\n<|im_start|>assistant\n"
    prompts = [hf.encode(text.format(w))[:24] for w in ("a river", "a city", "a storm", "a garden") * (args.batch // 4)]
    prompts += prompts[: args.batch - len(prompts)]
    meter = CpuMeter()
    plain = SamplingParams(temperature=0.0, ignore_eos=True)
    decode_step_times(runner, prompts[:4], plain, 2, grammar)  # warm-up
    free_steps, constrained_steps = [], []
    for _ in range(2):
        free_steps += decode_step_times(runner, prompts, plain, args.new_tokens)
        constrained_steps += decode_step_times(runner, prompts, plain, args.new_tokens, grammar)
    free, constrained = statistics.median(free_steps), statistics.median(constrained_steps)
    parts = mask_parts(runner, grammar, args.batch)
    print(f"batch {args.batch}, {args.new_tokens} new tokens, greedy; schema compiled once in {compile_s * 1e3:.0f} ms")
    print(f"median decode step  unconstrained {free * 1e3:8.1f} ms   constrained {constrained * 1e3:8.1f} ms   "
          f"ratio {constrained / free:.3f}")
    print(f"grammar work per step (fill {args.batch} bitmasks + mask the logits): {parts * 1e3:.1f} ms")
    print(f"{meter.lap()}")


if __name__ == "__main__":
    main()

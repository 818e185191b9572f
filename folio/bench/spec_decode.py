"""Speculative decoding, measured in one run: decode tokens/s with and without speculation.

The engine is the real scheduler policy, block allocator and model runner stepped in this process
(``folio.core.engine.EngineCore``: the services' step without sockets), greedy, on
SmolLM2-135M-Instruct. Decode tokens/s counts the tokens generated after every request of the
batch has its first token (prefill excluded) over the time they took. For each proposer, at batch
1 and at a larger batch, it prints tokens/s without speculation (the baseline, same run), with it,
the ratio, and the mean accepted length (tokens per verification: accepted drafts + 1).

- n-gram prompt lookup on a repetitive workload: copy or extract from a long document given in
  the prompt, where the output repeats the input;
- a draft model: SmolLM2's own first ``--draft-layers`` layers with its embeddings and head
  (``folio.core.models.truncate_layers``; an early-exit draft, not one trained for the job), on the same
  workload;
- the target as its own draft ("self"): every draft is accepted, so it shows the ceiling of the
  accepted length and what drafting at the target's cost does to the speed.

    python scripts/bench_spec_decode.py [--batch 8] [--max-tokens 96] [--k 4] [--draft-layers 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from folio.core.engine import EngineCore
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import DEFAULT_MODEL_NAME, RuntimeConfig, cache_dir
from folio.shared.messages import EngineRequest, WireSampling
from folio.core.models import resolve_model, truncate_layers

DOCUMENT = (
    "The harbor town of Westmere keeps three lighthouses. The north light was built in 1821 from grey "
    "granite and still burns oil on winter nights. The south light stands on a reef two miles out and is "
    "reached only at low tide. The east light was rebuilt after the storm of 1954, when waves tore away its "
    "lantern room. Each keeper writes the weather, the ships that pass and the state of the lamp in a log "
    "book, and the town library keeps every log book since 1830. Visitors may read them on Tuesdays."
)
TASKS = [
    "Copy the following text exactly, word for word:\n\n",
    "Repeat the following text, sentence by sentence, without changing anything:\n\n",
    "Extract every sentence that mentions a lighthouse from this text, unchanged:\n\n",
    "Rewrite the following text exactly as it is:\n\n",
]


def workload(tokenizer, num: int) -> list[list[int]]:
    prompts = []
    for i in range(num):
        messages = [{"role": "user", "content": TASKS[i % len(TASKS)] + DOCUMENT}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def decode_rate(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, eos: int) -> tuple[float, float, list]:
    """(decode tokens/s, mean accepted length, outputs)."""
    engine = EngineCore(runner, max_num_batched_tokens=4096)
    outputs: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(req_id=f"b{i}", prompt_token_ids=p, eos_token_id=eos,
                                         sampling=WireSampling(temperature=0.0, max_tokens=max_tokens)))
    t0 = tokens0 = None
    while (deltas := engine.step()) is not None:
        for d in deltas:
            outputs[d.req_id].extend(d.token_ids)
        if t0 is None and all(outputs.values()):
            t0, tokens0 = time.perf_counter(), sum(map(len, outputs.values()))
    elapsed = time.perf_counter() - t0
    tokens = sum(map(len, outputs.values())) - tokens0
    c = engine.scheduler.counters
    accepted = 1 + c["num_spec_accepted_tokens"] / c["num_spec_drafts"] if c["num_spec_drafts"] else float("nan")
    return tokens / elapsed, accepted, [outputs[f"b{i}"] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--batch", type=int, default=8, help="the larger batch (the other is 1)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--draft-layers", type=int, default=8)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = workload(tokenizer, args.batch)
    draft = truncate_layers(path, cache_dir() / "models" / f"{Path(path).name}-first{args.draft_layers}", args.draft_layers)
    base = dict(num_kv_blocks=1024, max_num_batched_tokens=4096, device="cpu", dtype="float32")
    runners = {
        "none": ModelRunner(RuntimeConfig(**base), path),
        "ngram": ModelRunner(RuntimeConfig(**base, speculative_model="ngram", num_speculative_tokens=args.k), path),
        "draft": ModelRunner(RuntimeConfig(**base, speculative_model=str(draft), num_speculative_tokens=args.k), path),
        "self": ModelRunner(RuntimeConfig(**base, speculative_model=path, num_speculative_tokens=args.k), path),
    }
    decode_rate(runners["none"], prompts[:1], 4, tokenizer.eos_token_id)  # warm-up
    print(f"model {args.model} on cpu (float32), greedy, {len(prompts[0])}-token prompts that copy a document, "
          f"up to {args.max_tokens} new tokens, k={args.k}; draft model: the target's first {args.draft_layers} "
          "layers + embeddings and head")
    print(f"{'proposer':<10}{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}{'accepted len':>14}")
    for batch in (1, args.batch):
        plain, _, want = decode_rate(runners["none"], prompts[:batch], args.max_tokens, tokenizer.eos_token_id)
        for name in ("ngram", "draft", "self"):
            rate, accepted, got = decode_rate(runners[name], prompts[:batch], args.max_tokens, tokenizer.eos_token_id)
            same = "" if got == want else "  (OUTPUT DIFFERS)"
            print(f"{name:<10}{batch:>6}{plain:>13.1f}{rate:>12.1f}{rate / plain:>8.2f}{accepted:>14.2f}{same}")


if __name__ == "__main__":
    main()

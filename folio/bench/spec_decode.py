"""Speculative decoding, measured in one run: tokens/s with and without speculation, per workload.

More in docs/modules.md (folio/bench/spec_decode.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from folio.core.engine import EngineCore
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import DEFAULT_MODEL_NAME, RuntimeConfig, cache_dir
from folio.shared.messages import EngineRequest
from folio.shared.sampling import SamplingParams
from folio.core.model_files import resolve_model, truncate_layers

DOCUMENT = (
    "The harbor town of Westmere keeps three lighthouses. The north light was built in 1821 from grey "
    "granite and still burns oil on winter nights. The south light stands on a reef two miles out and is "
    "reached only at low tide. The east light was rebuilt after the storm of 1954, when waves tore away its "
    "lantern room. Each keeper writes the weather, the ships that pass and the state of the lamp in a log "
    "book, and the town library keeps every log book since 1830. Visitors may read them on Tuesdays."
)
COPY_TASKS = [
    "Copy the following text exactly, word for word:\n\n",
    "Repeat the following text, sentence by sentence, without changing anything:\n\n",
    "Extract every sentence that mentions a lighthouse from this text, unchanged:\n\n",
    "Rewrite the following text exactly as it is:\n\n",
]
CHAT = [
    "What are three good habits for staying healthy?", "Explain what a black hole is in simple words.",
    "Give me a recipe idea for a quick vegetarian dinner.", "Why is the sky blue?",
    "Write a haiku about autumn leaves.", "What should I pack for a weekend camping trip?",
    "How do airplanes stay in the air?", "Suggest a name for a friendly orange cat.",
    "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
    "How can I get better at remembering names?", "Describe a sunset over the ocean.",
    "What are the main causes of earthquakes?", "Give two tips for writing a good email.",
    "Why do we need sleep?", "What is photosynthesis?",
]
CODE = '''def total_price(items, tax):
    total = 0
    for item in items:
        total += item["price"] * item["quantity"]
    return total * (1 + tax)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
EDITS = ["Add a docstring to each function.", "Rename the variable total to subtotal.",
         "Make tax default to 0.2.", "Add type hints to both functions.", "Return None early when items is empty."]


def encode(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_wave(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, eos: int, counters: dict) -> tuple:
    """(decode tokens, decode seconds, outputs) of one batch run to the end."""
    engine = EngineCore(runner, max_num_batched_tokens=4096)
    outputs: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(req_id=f"b{i}", prompt_token_ids=p, eos_token_id=eos,
                                         sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    t0 = tokens0 = None
    while (deltas := engine.step()) is not None:
        for d in deltas.all_deltas():
            outputs[d.req_id].extend(d.token_ids)
        if t0 is None and all(outputs.values()):
            t0, tokens0 = time.perf_counter(), sum(map(len, outputs.values()))
    elapsed = time.perf_counter() - t0
    for key in ("num_spec_drafts", "num_spec_accepted_tokens", "num_steps"):
        counters[key] = counters.get(key, 0) + engine.scheduler.counters[key]
    return sum(map(len, outputs.values())) - tokens0, elapsed, [outputs[f"b{i}"] for i in range(len(prompts))]


def run_workload(runner, tokenizer, workload: str, batch: int, max_tokens: int) -> tuple[float, dict, list]:
    """(decode tokens/s, counters, outputs) of ``batch`` sequences of the workload."""
    eos, counters, tokens, seconds, outs = tokenizer.eos_token_id, {}, 0, 0.0, []
    if workload == "edit":  # 5 turns; each conversation carries its own answers forward
        convs = [[{"role": "user", "content": f"Here is my file (version {i}):\n\n{CODE}\nShow the whole file."}]
                 for i in range(batch)]
        for turn in range(len(EDITS) + 1):
            n, s, got = run_wave(runner, [encode(tokenizer, c) for c in convs], max_tokens, eos, counters)
            tokens, seconds, outs = tokens + n, seconds + s, outs + got
            if turn < len(EDITS):
                for c, answer in zip(convs, got):
                    c += [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                          {"role": "user", "content": EDITS[turn] + " Show the whole file."}]
        return tokens / seconds, counters, outs
    if workload == "chat":
        prompts = [encode(tokenizer, [{"role": "user", "content": CHAT[i % len(CHAT)]}]) for i in range(batch)]
    else:
        prompts = [encode(tokenizer, [{"role": "user", "content": COPY_TASKS[i % len(COPY_TASKS)] + DOCUMENT}])
                   for i in range(batch)]
    tokens, seconds, outs = run_wave(runner, prompts, max_tokens, eos, counters)
    return tokens / seconds, counters, outs


def speculative_configs(k: int, eagle_model: str | None, tree=True) -> dict[str, dict]:
    """``--speculative-config`` of the proposers that have one (the closed waves add their payoff);
    ``tree``: the eagle3 trees' shape (true: ``spec_config.default_tree``, or paths)."""
    eagle = {"method": "eagle3", "num_speculative_tokens": k, **({"model": eagle_model} if eagle_model else {})}
    return {"ngram-adaptive": {"method": "ngram", "num_speculative_tokens": k}, "suffix": {"method": "suffix"},
            "eagle3": eagle, "eagle3-always": {**eagle, "adaptive": False},
            # a tree of drafts (spec_config.default_tree): chosen per step against the chain and
            # plain decoding, or drafted every step
            "eagle3-tree": {**eagle, "tree": tree}, "eagle3-tree-always": {**eagle, "tree": tree, "adaptive": False}}


# ---------------------------------------------------------------------------- served, open loop
def served_prompts(tokenizer, workload: str, num: int) -> list[list[int]]:
    """The served section's requests: chat prompts, or (mixed) chat and copy tasks in turn."""
    chat = [encode(tokenizer, [{"role": "user", "content": CHAT[i % len(CHAT)]}]) for i in range(num)]
    if workload == "chat":
        return chat
    copy = [encode(tokenizer, [{"role": "user", "content": COPY_TASKS[i % len(COPY_TASKS)] + DOCUMENT}])
            for i in range(num)]
    return [chat[i] if i % 2 == 0 else copy[i] for i in range(num)]


async def open_loop(base_url: str, model: str, prompts: list[list[int]], arrivals: list[float],
                    max_tokens: int) -> tuple[float, float, list[str]]:
    """Each prompt sent at its arrival time whatever came back before (open loop): (completion
    tokens/s from the first send to the last answer, mean seconds from arrival to answer, texts)."""
    import asyncio

    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        async def one(prompt: list[int], at: float) -> tuple[int, float, str]:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent = time.perf_counter()
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            async with session.post(base_url + "/completions", json=body) as resp:
                resp.raise_for_status()
                out = await resp.json()
            return out["usage"]["completion_tokens"], time.perf_counter() - sent, out["choices"][0]["text"]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p, at) for p, at in zip(prompts, arrivals)))
    elapsed = time.perf_counter() - t0
    return sum(n for n, _, _ in done) / elapsed, sum(s for _, s, _ in done) / len(done), [t for _, _, t in done]


def served_section(args, path: str, tokenizer) -> None:
    """Plain, each proposer (payoff served), plain again: one ``folio serve`` at a time, the same
    requests at the same (seeded Poisson) arrival times."""
    import asyncio
    import random

    from folio.testing.server import start_server, stop_server

    prompts = served_prompts(tokenizer, args.served_workload, args.served_requests)
    rng = random.Random(0)
    arrivals, at = [], 0.0
    for _ in prompts:
        arrivals.append(at)
        at += rng.expovariate(args.served_rate) if args.served_rate > 0 else 0.0
    rate = f"{args.served_rate:g}/s Poisson" if args.served_rate > 0 else "all at once"
    print(f"\nserved, open loop: {len(prompts)} {args.served_workload} requests ({rate}), up to {args.max_tokens} "
          f"tokens each, greedy; payoff served")
    print(f"{'proposer':<16}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}{'plain s/req':>13}{'spec s/req':>12}"
          f"{'s/req ratio':>13}{'accepted len':>14}")
    base = ["--quantization", args.quantization, "--max-num-seqs", str(max(64, len(prompts)))]
    configs = speculative_configs(args.k, args.eagle_model, args.tree)

    def run(flags: list[str]) -> tuple[float, float, list[str], float]:
        server = start_server(path, *base, *flags)
        try:
            asyncio.run(open_loop(server.base_url, args.model, prompts[:1], [0.0], 4))  # warm-up
            out = asyncio.run(open_loop(server.base_url, args.model, prompts, arrivals, args.max_tokens))
            return (*out, server.admin("scheduler", "stats").get("spec_mean_accepted_length", 1.0))
        finally:
            stop_server(server)

    before = run([])
    results = {name: run(["--speculative-config", json.dumps({**configs[name], "payoff": "served"})])
               for name in args.proposers if name in configs}
    after = run([])
    plain, plain_s = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    for name, (rate_, latency, texts, accepted) in results.items():
        same = "" if texts == before[2] else "  (OUTPUT DIFFERS)"
        print(f"{name:<16}{plain:>13.1f}{rate_:>12.1f}{rate_ / plain:>8.2f}{plain_s:>13.2f}{latency:>12.2f}"
              f"{plain_s / latency:>13.2f}{accepted:>14.2f}{same}", flush=True)


def make_runners(path: str, names: list[str], k: int, draft_layers: int, quantization: str,
                 eagle_model: str | None = None, tree=True) -> dict:
    base = dict(num_kv_blocks=4096, max_num_batched_tokens=4096, max_num_seqs=64, device="cpu",
                quantization=quantization)
    configs = {"ngram": dict(speculative_model="ngram", num_speculative_tokens=k),
               **{name: dict(speculative_config=json.dumps({**spec, **({} if name.endswith("-always") else
                                                                         {"payoff": "closed"})}))
                  for name, spec in speculative_configs(k, eagle_model, tree).items()},
               "self": dict(speculative_model=path, num_speculative_tokens=k)}
    if "draft" in names:
        draft = truncate_layers(path, cache_dir() / "models" / f"{Path(path).name}-first{draft_layers}", draft_layers)
        configs["draft"] = dict(speculative_model=str(draft), num_speculative_tokens=k)
    return {name: ModelRunner(RuntimeConfig(**base, **configs.get(name, {})), path) for name in ["plain", *names]}


def fresh_speculation(runner: ModelRunner) -> None:
    """Forget what earlier runs taught: the suffix trie (the same prompts come again at the next
    batch size) and the measured speeds."""
    from folio.core.executor.runtime.spec_control import SpecController
    from folio.core.executor.runtime.spec_suffix import SuffixProposer

    if isinstance(runner.proposer, SuffixProposer):
        runner.proposer.tries.clear()
        runner.proposer.cached.clear()
    if runner.spec_control is not None:
        runner.spec_control = SpecController(payoff=runner.spec_control.payoff)
        runner.spec_control.first_decision(runner.drafts_now)
    if runner.tree_control is not None:
        runner.tree_control = SpecController(payoff=runner.tree_control.payoff)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--quantization", default="auto", help="the runners' --quantization (auto: as served)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--workloads", nargs="+", default=["chat", "edit", "copy"], choices=("chat", "edit", "copy"))
    parser.add_argument("--proposers", nargs="+", default=["ngram", "ngram-adaptive", "suffix"],
                        choices=("ngram", "ngram-adaptive", "suffix", "draft", "self", "eagle3", "eagle3-always",
                                 "eagle3-tree", "eagle3-tree-always"))
    parser.add_argument("--eagle-model", default=None, help="eagle3: a head folder (default: the shipped one)")
    parser.add_argument("--tree", type=json.loads, default=True,
                        help='eagle3-tree*: the tree as JSON paths, e.g. "[[0], [1], [0, 0]]" (default: the default tree)')
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (ngram, draft, self, eagle3)")
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--served", action="store_true",
                        help="also the served, open-loop section (folio serve, requests at seeded Poisson times)")
    parser.add_argument("--served-only", action="store_true", help="only the served section")
    parser.add_argument("--served-workload", default="mixed", choices=("chat", "mixed"))
    parser.add_argument("--served-requests", type=int, default=32)
    parser.add_argument("--served-rate", type=float, default=0.0, help="requests/s (0: all at once)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not args.served_only:
        closed_section(args, path, tokenizer)
    if args.served or args.served_only:
        served_section(args, path, tokenizer)


def closed_section(args, path: str, tokenizer) -> None:
    """Closed waves in process: each batch run to its last row (payoff closed), plain before and after."""
    runners = make_runners(path, args.proposers, args.k, args.draft_layers, args.quantization, args.eagle_model,
                           args.tree)
    run_workload(runners["plain"], tokenizer, "chat", 1, 4)  # warm-up
    print(f"model {args.model} on cpu (--quantization {args.quantization}), greedy, up to {args.max_tokens} new "
          f"tokens per turn, k={args.k} (suffix: up to 8, from the match), "
          f"GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'unset')}")
    print(f"{'workload':<9}{'proposer':<16}{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'ratio':>8}"
          f"{'accepted len':>14}{'drafted':>9}")
    for workload in args.workloads:
        for batch in args.batches:
            before, _, want = run_workload(runners["plain"], tokenizer, workload, batch, args.max_tokens)
            results = {}
            for name in args.proposers:
                fresh_speculation(runners[name])
                results[name] = run_workload(runners[name], tokenizer, workload, batch, args.max_tokens)
            after, _, _ = run_workload(runners["plain"], tokenizer, workload, batch, args.max_tokens)
            plain = (before + after) / 2
            for name, (rate, c, got) in results.items():
                accepted = 1 + c["num_spec_accepted_tokens"] / c["num_spec_drafts"] if c["num_spec_drafts"] else 1.0
                drafted = c["num_spec_drafts"] / max(1, c["num_steps"] * batch)
                same = "" if got == want else "  (OUTPUT DIFFERS)"
                print(f"{workload:<9}{name:<16}{batch:>6}{plain:>13.1f}{rate:>12.1f}{rate / plain:>8.2f}"
                      f"{accepted:>14.2f}{drafted:>9.2f}{same}", flush=True)


if __name__ == "__main__":
    main()

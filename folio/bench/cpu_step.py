"""One decode step of a quantized model on the CPU, part by part: the layer stack's kernels (from its
own counters: norms, qkv, RoPE + KV write, attention, o, gate_up, SiLU x gate, down), the LM head,
and the rest of the executor's step (embedding lookup, sampling, the plan's bookkeeping).

    folio bench cpu_step [--model M] [--batches 1 9 32] [--verify 9] [--context 128] [--steps 24]
                         [--repeats 3] [--passes 1 2]

Each batch runs ``--steps`` decode steps after a prefill of ``--context`` tokens a row, in
process (the model runner alone: no scheduler, no sockets); ``--verify N`` adds a step of one row
scoring N tokens, as speculation's verify step does, and its ratio to a one-token step of the same
round. Every configuration runs once a round, ``--repeats`` rounds, medians. Prints ``label:
value`` lines (``folio bench`` collects them) in ms per step, and the weights' GB/s of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
import torch

BLOCK = 16


def run_batch(runner, batch: int, context: int, steps: int, verify: int = 1) -> dict[str, float]:
    """Mean ms per decode step of each part, over ``steps`` steps after a prefill. ``verify`` > 1:
    each row a step scores its last token and ``verify - 1`` random drafts (mostly rejected), as a
    speculative verify step does; ``runner`` must have a proposer (its drafts are replaced)."""
    from folio.core.executor.kernels import cpu_kernels
    from folio.core.executor.runtime.spec_decode import Proposal
    from folio.shared.messages import NewRequestData, RunningRequestData, StepPlan
    from folio.shared.sampling import SamplingParams

    per_row = (context + steps * verify + BLOCK) // BLOCK + 1
    params = SamplingParams(temperature=0, max_tokens=per_row * BLOCK, ignore_eos=True)
    ids = [f"b{batch}-v{verify}-{i}" for i in range(batch)]
    tokens = torch.randint(0, runner.spec.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    new = [NewRequestData(req_id=r, token_ids=tokens[i].tolist(), num_prompt_tokens=context, sampling=params,
                          block_ids=list(range(i * per_row, (i + 1) * per_row)))
           for i, r in enumerate(ids)]
    runner.execute(StepPlan(step_id=0, new_reqs=new, num_scheduled_tokens={r: context for r in ids}))
    stack = runner.backend.stack
    profile = np.zeros(len(cpu_kernels.STACK_PARTS), dtype=np.int64)
    head = {"s": 0.0}
    logits_of = runner.model.compute_logits

    def timed_logits(hidden):
        t0 = time.perf_counter()
        out = logits_of(hidden)
        head["s"] += time.perf_counter() - t0
        return out

    runner.model.compute_logits = timed_logits
    computed, total = dict.fromkeys(ids, context), 0.0
    drafts = torch.Generator().manual_seed(1)
    try:
        for step in range(1, steps + 1):
            running = [RunningRequestData(req_id=r, new_block_ids=[], num_computed_tokens=computed[r]) for r in ids]
            spec = {r: torch.randint(0, runner.spec.vocab_size, (verify - 1,), generator=drafts).tolist()
                    for r in ids} if verify > 1 else {}
            for r, d in spec.items():  # as if the runner's proposer had drafted them
                runner.requests[r].proposal = Proposal(d)
            plan = StepPlan(step_id=step, running_reqs=running, spec_token_ids=spec,
                            num_scheduled_tokens=dict.fromkeys(ids, verify))
            t0 = time.perf_counter()
            result = runner.execute(plan)
            if step == 1:  # the first step warms up; the profile counts from the second
                profile[:] = 0
                head["s"] = 0.0
                stack.profile = profile
            else:
                total += time.perf_counter() - t0
            for r, sampled in zip(result.req_ids, result.sampled_token_ids()):
                computed[r] += len(sampled)
    finally:
        runner.model.compute_logits = logits_of
        stack.profile = None
        runner.execute(StepPlan(step_id=steps + 1, finished_req_ids=ids))
    n = steps - 1
    parts = {name: profile[i] / 1e6 / n for i, name in enumerate(cpu_kernels.STACK_PARTS)}
    parts["lm head"] = head["s"] * 1e3 / n
    parts["rest of the step"] = total * 1e3 / n - sum(parts.values())
    parts["step"] = total * 1e3 / n
    return parts


def main(argv: list[str] | None = None) -> int:
    from folio.core.executor.quant.linear import QuantLinear
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.core.model_files import resolve_model
    from folio.shared.config import RuntimeConfig

    parser = argparse.ArgumentParser(prog="folio bench cpu_step", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 9, 32])
    parser.add_argument("--verify", nargs="*", type=int, default=[9],
                        help="also one row scoring this many tokens a step (a speculative verify step)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every configuration in turn (medians)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--passes", nargs="+", type=int, default=[QuantLinear.passes], choices=(1, 2))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    per_row = (args.context + args.steps * max([1, *args.verify]) + BLOCK) // BLOCK + 1
    config = RuntimeConfig(device="cpu", num_kv_blocks=max(args.batches) * per_row, block_size=BLOCK,
                           max_num_seqs=max(args.batches), max_num_batched_tokens=max(args.batches) * args.context)
    runner = ModelRunner(config, str(resolve_model(args.model)))
    drafter = []

    def drafting():  # a second runner with a proposer (n-gram), for the verify steps
        if not drafter:
            spec = json.dumps({"method": "ngram", "num_speculative_tokens": max(args.verify) - 1})
            drafter.append(ModelRunner(dataclasses.replace(config, speculative_config=spec),
                                       str(resolve_model(args.model))))
        return drafter[0]
    if runner.backend.stack is None:
        raise SystemExit("this model does not run the CPU kernels' layer stack")
    weights = sum(m.weight_packed.nbytes for m in runner.model.modules() if isinstance(m, QuantLinear))
    head = runner.model.packed_lm_head
    weights += head.tiles.nbytes if getattr(head, "tiles", None) is not None else 0
    print(f"{args.model}: {runner.model.quantization} ({getattr(runner.model, 'weight_types', '')}), "
          f"{weights / 1e6:.1f} MB of weights a step, {args.threads} threads, context {args.context}, "
          f"GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'unset')}")
    for passes in args.passes:
        QuantLinear.passes = passes
        for r in [runner, *drafter]:
            r.model.__dict__.pop("_stack_layout", None)
            if getattr(r.model.packed_lm_head, "_qgemm", None) is not None:
                r.model.packed_lm_head._qgemm = None
        configs = [(b, 1) for b in args.batches] + [(1, v) for v in args.verify]
        if args.verify and 1 not in args.batches:
            configs.insert(0, (1, 1))  # the verify steps' baseline
        # each configuration once a round, the rounds in turn: a noisy machine slows all alike
        rounds = [[run_batch(runner if v == 1 else drafting(), b, args.context, args.steps, v) for b, v in configs]
                  for _ in range(args.repeats)]
        step = {c: float(np.median([r[i]["step"] for r in rounds])) for i, c in enumerate(configs)}
        for i, (batch, verify) in enumerate(configs):
            parts = {k: float(np.median([r[i][k] for r in rounds])) for k in rounds[0][i]}
            tag = f"passes {passes} batch {batch}" + (f" verify {verify}" if verify > 1 else "")
            print(f"{tag} " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if k != "step"))
            print(f"{tag} ms/step: {step[batch, verify]:.3f}")
            if verify > 1:
                ratios = [r[i]["step"] / r[configs.index((1, 1))]["step"] for r in rounds]
                print(f"{tag} / batch 1 step: {float(np.median(ratios)):.2f} (rounds: "
                      + ", ".join(f"{x:.2f}" for x in ratios) + ")")
            else:
                print(f"{tag} tok/s: {batch * 1e3 / step[batch, verify]:.1f}")
            print(f"{tag} weight GB/s: {weights / step[batch, verify] / 1e6:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

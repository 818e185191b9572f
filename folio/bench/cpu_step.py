"""One decode step of a quantized model on the CPU, part by part: the layer stack's kernels (from its
own counters: norms, qkv, RoPE + KV write, attention, o, gate_up, SiLU x gate, down), the LM head,
and the rest of the executor's step (embedding lookup, sampling, the plan's bookkeeping).

    folio bench cpu_step [--model M] [--batches 1 9 32] [--context 128] [--steps 24] [--passes 1 2]

Each batch runs ``--steps`` decode steps after a prefill of ``--context`` tokens a row, in
process (the model runner alone: no scheduler, no sockets); prints ``label: value`` lines
(``folio bench`` collects them) in ms per step, and the weights' GB/s of the whole step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

BLOCK = 16


def run_batch(runner, batch: int, context: int, steps: int) -> dict[str, float]:
    """Mean ms per decode step of each part, over ``steps`` steps after a prefill."""
    from folio.core.executor.kernels import cpu_kernels
    from folio.shared.messages import NewRequestData, RunningRequestData, StepPlan
    from folio.shared.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=context + steps + 4, ignore_eos=True)
    per_row = (context + steps + BLOCK) // BLOCK + 1
    ids = [f"b{batch}-{i}" for i in range(batch)]
    tokens = torch.randint(0, runner.spec.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    new = [NewRequestData(req_id=r, token_ids=tokens[i].tolist(), num_prompt_tokens=context, sampling=params,
                          block_ids=list(range(i * per_row, i * per_row + (context + BLOCK - 1) // BLOCK)))
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
    computed, total = context, 0.0
    try:
        for step in range(1, steps + 1):
            grow = computed % BLOCK == 0
            running = [RunningRequestData(req_id=r, new_block_ids=[i * per_row + computed // BLOCK] if grow else [],
                                          num_computed_tokens=computed) for i, r in enumerate(ids)]
            plan = StepPlan(step_id=step, running_reqs=running, num_scheduled_tokens={r: 1 for r in ids})
            if step == 1:  # the first step warms up; the profile counts from the second
                runner.execute(plan)
                profile[:] = 0
                head["s"] = 0.0
                stack.profile = profile
            else:
                t0 = time.perf_counter()
                runner.execute(plan)
                total += time.perf_counter() - t0
            computed += 1
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
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--passes", nargs="+", type=int, default=[QuantLinear.passes], choices=(1, 2))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    per_row = (args.context + args.steps + BLOCK) // BLOCK + 1
    config = RuntimeConfig(device="cpu", num_kv_blocks=max(args.batches) * per_row, block_size=BLOCK,
                           max_num_seqs=max(args.batches), max_num_batched_tokens=max(args.batches) * args.context)
    runner = ModelRunner(config, str(resolve_model(args.model)))
    if runner.backend.stack is None:
        raise SystemExit("this model does not run the CPU kernels' layer stack")
    weights = sum(m.weight_packed.nbytes for m in runner.model.modules() if isinstance(m, QuantLinear))
    head = runner.model.packed_lm_head
    weights += head.tiles.nbytes if getattr(head, "tiles", None) is not None else 0
    print(f"{args.model}: {runner.model.quantization} ({getattr(runner.model, 'weight_types', '')}), "
          f"{weights / 1e6:.1f} MB of weights a step, {args.threads} threads, context {args.context}")
    for passes in args.passes:
        QuantLinear.passes = passes
        runner.model.__dict__.pop("_stack_layout", None)
        if getattr(head, "_qgemm", None) is not None:
            head._qgemm = None
        for batch in args.batches:
            parts = run_batch(runner, batch, args.context, args.steps)
            tag = f"passes {passes} batch {batch}"
            print(f"{tag} " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if k != "step"))
            print(f"{tag} ms/step: {parts['step']:.3f}")
            print(f"{tag} tok/s: {batch * 1e3 / parts['step']:.1f}")
            print(f"{tag} weight GB/s: {weights / parts['step'] / 1e6:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

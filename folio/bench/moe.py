"""A mixture-of-experts decode step against a dense one with the same active parameters, on the CPU.

More in docs/modules.md (folio/bench/moe.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.model.moe import MoE
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.testing.models import write_tiny_model
from folio.bench.cpu_meter import CpuMeter

CONTEXT, BLOCK = 64, 16


def per_token_forward(self: MoE, x: torch.Tensor, ops=None) -> torch.Tensor:
    """The baseline: every token's experts one at a time (a Python loop over tokens)."""
    experts, weights = self.route(x)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t]):
            gate_up, down = self.expert(e)
            gate, up = gate_up(x[t : t + 1]).chunk(2, dim=-1)
            y[t] += w * down(F.silu(gate) * up)[0]
    return y


def decode_step(runner: ModelRunner, batch: int):
    """One decode step's forward pass and logits: ``batch`` sequences, one new token each."""
    per_seq = CONTEXT // BLOCK
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [CONTEXT] * batch, tables, None, BLOCK)
    ids, positions = torch.randint(0, runner.spec.vocab_size, (batch,)), torch.full((batch,), CONTEXT - 1)
    model = runner.model
    return lambda: model.compute_logits(model(ids, positions, runner.pool.kv_caches, meta, runner.backend))


def step_ms(steps: int, *runs) -> list[float]:
    """Median ms of each of ``runs`` (step callables), timed in turns (one step of each, ``steps``
    times, after 3 warm-up turns), so that the load other processes put on the machine falls on
    all of them alike."""
    times = [[] for _ in runs]
    with torch.inference_mode():
        for i in range(steps + 3):
            for run, spent in zip(runs, times):
                t0 = time.perf_counter()
                run()
                if i >= 3:
                    spent.append(time.perf_counter() - t0)
    return [1000 * statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    sizes = {"--steps": (30, "timed steps of each model, after 3 warm-up steps"), "--batch": (64, "decode rows a step"), "--hidden": (512, "hidden size"),
             "--expert-size": (512, "each expert's intermediate size I"), "--layers": (4, "decoder layers")}
    for flag, (default, what) in sizes.items():
        ap.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    ap.add_argument("--profile", action="store_true", help="print the MoE step's operations (torch profiler)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the comparison is of work, not of thread scaling on a shared machine
    shape = dict(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=2 * CONTEXT)
    blocks = args.batch * CONTEXT // BLOCK
    config = RuntimeConfig(num_kv_blocks=blocks, block_size=BLOCK, dtype="float32")
    meter = CpuMeter()
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir = write_tiny_model(Path(tmp) / "moe", "mixtral", num_local_experts=8, num_experts_per_tok=2,
                                   intermediate_size=args.expert_size, **shape)
        dense_dir = write_tiny_model(Path(tmp) / "dense", "llama", intermediate_size=2 * args.expert_size, **shape)
        moe, dense = ModelRunner(config, moe_dir), ModelRunner(config, dense_dir)
        meter.lap()
        dense_step, moe_step = decode_step(dense, args.batch), decode_step(moe, args.batch)
        dense_ms, moe_ms = step_ms(args.steps, dense_step, moe_step)
        grouped = MoE.forward

        def loop_step():
            MoE.forward = per_token_forward
            try:
                moe_step()
            finally:
                MoE.forward = grouped

        loop_ms, grouped_ms = step_ms(max(3, args.steps // 5), loop_step, moe_step)
        others = meter.lap()
        if args.profile:
            from torch.profiler import profile

            with torch.inference_mode(), profile() as prof:
                for _ in range(args.steps):
                    moe_step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(f"batch {args.batch}, hidden {args.hidden}, {args.layers} layers, 8 experts top-2 of size "
          f"{args.expert_size} against a dense MLP of {2 * args.expert_size}; fp32, one thread")
    print(f"dense step: {dense_ms:.2f} ms")
    print(f"MoE step (tokens grouped by expert): {moe_ms:.2f} ms")
    print(f"MoE step (a loop over tokens): {loop_ms:.2f} ms")
    print(f"MoE / dense: {moe_ms / dense_ms:.2f}x (target at most 1.5x)")
    print(f"per-token loop / grouped: {loop_ms / grouped_ms:.1f}x")
    print(f"measured over {others}")


if __name__ == "__main__":
    main()

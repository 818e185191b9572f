"""The executor's own cost per step: the real runner with a null model.

The null model keeps what the runner drives (embedding lookup, the KV write of every layer, the
final LM head) and drops the layers' arithmetic: what is left is the host work of a step
(applying the plan's diffs to the persistent batch, gathering inputs and attention metadata, the
copy to the device, the sampler, appending the sampled tokens) plus the smallest device work
that has to go with it. It runs a vocabulary of 512 so that the sampler's arithmetic does not
hide its overhead. Decode steps at batch 1, 64 and 256, greedy and with temperature 0.8, top-p
0.95 and presence/frequency/repetition penalties; ms per step for each.

More in docs/modules.md (folio/bench/step.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import tempfile
import time

import msgspec
import torch

from folio.bench.cpu_meter import CpuMeter
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import NewRequestData, RunningRequestData, StepPlan
from folio.shared.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                         repetition_penalty=1.1, max_tokens=1 << 20, ignore_eos=True)
PROMPT_LEN, BLOCK_SIZE = 16, 16
# the SmolLM2 case: temperature 0.8, top-p 0.95 and a presence penalty
SMOLLM_SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.5, max_tokens=1 << 20,
                                ignore_eos=True)


class NullModel(torch.nn.Module):
    """The runner's model interface with layers that only write their K/V (a slice of the input)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.spec = model, model.spec

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        kv = x[:, : self.spec.num_kv_heads * self.spec.head_dim].view(-1, self.spec.num_kv_heads, self.spec.head_dim)
        for k_cache, v_cache in kv_caches:
            backend.write_kv(kv, kv, k_cache, v_cache, meta)
        return x

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def null_runner(folder: str, device: str, max_num_seqs: int) -> ModelRunner:
    from folio.testing.models import write_tiny_model

    path = write_tiny_model(folder, vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            max_position_embeddings=4096)
    config = RuntimeConfig(device=device, dtype="float32", num_kv_blocks=max_num_seqs * 8, max_num_seqs=max_num_seqs,
                           block_size=BLOCK_SIZE, attention_backend="torch")
    runner = ModelRunner(config, path)
    runner.model = NullModel(runner.model)
    return runner


def decode_steps(runner: ModelRunner, batch: int, params: SamplingParams, steps: int, profile: cProfile.Profile | None,
                 grammar=None):
    """Prefill ``batch`` prompts (constrained by ``grammar``, if given), then time ``steps`` decode
    steps; returns seconds per step."""
    rng = torch.Generator().manual_seed(batch)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    blocks = {r: [i * 8] for i, r in enumerate(ids)}
    new = [NewRequestData(req_id=r, token_ids=torch.randint(0, 512, (PROMPT_LEN,), generator=rng).tolist(),
                          num_prompt_tokens=PROMPT_LEN, sampling=params, block_ids=blocks[r], grammar=grammar)
           for r in ids]
    runner.execute(StepPlan(step_id=0, new_reqs=new, num_scheduled_tokens={r: PROMPT_LEN for r in ids}))
    computed, elapsed = PROMPT_LEN, 0.0
    for step in range(1, steps + 1):
        grow = computed % BLOCK_SIZE == 0  # the token computed now opens a block
        running = [RunningRequestData(req_id=r, new_block_ids=[blocks[r][0] + computed // BLOCK_SIZE] if grow else [],
                                      num_computed_tokens=computed) for r in ids]
        plan = StepPlan(step_id=step, running_reqs=running, num_scheduled_tokens={r: 1 for r in ids})
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        runner.execute(plan)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - t0
        if profile is not None:
            profile.disable()
        computed += 1
    runner.execute(StepPlan(step_id=steps + 1, finished_req_ids=ids))
    return elapsed / steps


def run_null(args) -> float:
    meter = CpuMeter()
    greedy_256 = 0.0
    with tempfile.TemporaryDirectory() as folder:
        runner = null_runner(folder, args.device, 256)
        decode_steps(runner, 8, GREEDY, 4, None)  # warm-up
        print(f"null model on {runner.device}, torch threads {torch.get_num_threads()}, {args.steps} decode steps")
        print(f"{'batch':>5} {'greedy ms':>10} {'sampled ms':>11} {'ratio':>6}")
        for batch in (1, 64, 256):
            profiles = [cProfile.Profile(), cProfile.Profile()] if args.profile and batch == 256 else [None, None]
            greedy, sampled = [], []
            for _ in range(args.repeats):  # alternating: a drift in the machine's speed hits both alike
                greedy.append(decode_steps(runner, batch, GREEDY, args.steps, profiles[0]))
                sampled.append(decode_steps(runner, batch, SAMPLED, args.steps, profiles[1]))
            g, s = min(greedy), min(sampled)
            for prof, order in zip(profiles, ("cumulative", "tottime")):
                if prof is not None:
                    pstats.Stats(prof).sort_stats(order).print_stats(25)
            print(f"{batch:>5} {g * 1e3:>10.3f} {s * 1e3:>11.3f} {s / g:>6.2f}", flush=True)
            if batch == 256:
                greedy_256 = g
    print(f"other processes kept {100 * meter.share()[1]:.0f}% of the CPUs busy meanwhile")
    return greedy_256 * 1e3


def run_smollm(args) -> None:
    """SmolLM2-135M-Instruct on the CPU at batch 64: decode steps greedy and sampled."""
    from folio.core.model_files import prepare_default_model

    config = RuntimeConfig(device="cpu", num_kv_blocks=64 * 8, max_num_seqs=64, block_size=BLOCK_SIZE,
                           quantization=args.smollm_quantization)
    runner = ModelRunner(config, str(prepare_default_model(quiet=True)))
    decode_steps(runner, 8, GREEDY, 2, None)  # warm-up
    meter = CpuMeter()
    greedy, sampled = [], []
    for _ in range(args.repeats):  # in turn, as for the null model
        greedy.append(decode_steps(runner, 64, GREEDY, args.steps, None))
        sampled.append(decode_steps(runner, 64, SMOLLM_SAMPLED, args.steps, None))
    g, s = min(greedy), min(sampled)
    print(f"SmolLM2 ({runner.model.quantization}) B=64: greedy {g * 1e3:.1f} ms/step, sampled (t 0.8, top-p 0.95, "
          f"presence 0.5) {s * 1e3:.1f} ms/step, ratio {s / g:.3f}; other processes kept "
          f"{100 * meter.share()[1]:.0f}% of the CPUs busy meanwhile", flush=True)
    constrained_step(runner, args, g)


def prefill_step(runner: ModelRunner, length: int) -> float:
    """Seconds for one step that prefills a ``length``-token prompt whole."""
    ids = torch.randint(0, 49152, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    blocks = list(range((length + BLOCK_SIZE - 1) // BLOCK_SIZE))
    plan = StepPlan(step_id=0, new_reqs=[NewRequestData(req_id="p", token_ids=ids, num_prompt_tokens=length,
                                                        sampling=GREEDY, block_ids=blocks)],
                    num_scheduled_tokens={"p": length})
    t0 = time.perf_counter()
    runner.execute(plan)
    elapsed = time.perf_counter() - t0
    runner.execute(StepPlan(step_id=1, finished_req_ids=["p"]))
    return elapsed


def run_invariance_cost(args) -> None:
    """SmolLM2 with ``--batch-invariant`` and without, in turns: decode steps at batch 1 and 64
    (greedy and sampled) and the prefill of a 512- and a 2048-token prompt; ms of each and on/off."""
    from folio.core.model_files import prepare_default_model

    path = str(prepare_default_model(quiet=True))
    runners = {}
    for on in (True, False):
        config = RuntimeConfig(device="cpu", num_kv_blocks=64 * 8 + 128, max_num_seqs=64, block_size=BLOCK_SIZE,
                               quantization=args.smollm_quantization, batch_invariant=on)
        runners[on] = ModelRunner(config, path)
        decode_steps(runners[on], 8, GREEDY, 2, None)  # warm-up
    cases = [(f"decode B={b} {kind}", lambda r, b=b, p=p: decode_steps(r, b, p, args.steps, None))
             for b in (1, 64) for kind, p in (("greedy", GREEDY), ("sampled", SMOLLM_SAMPLED))]
    cases += [(f"prefill {n} tokens", lambda r, n=n: prefill_step(r, n)) for n in (512, 2048)]
    meter = CpuMeter()
    print(f"SmolLM2 ({runners[True].model.quantization}) batch invariance on/off, fastest of {args.repeats}")
    print(f"{'case':<24} {'on ms':>9} {'off ms':>9} {'on/off':>7}")
    for name, run in cases:
        times = {True: [], False: []}
        for _ in range(args.repeats):  # in turns: a drift in the machine's speed hits both alike
            for on in (True, False):
                times[on].append(run(runners[on]))
        on, off = min(times[True]) * 1e3, min(times[False]) * 1e3
        print(f"{name:<24} {on:>9.1f} {off:>9.1f} {on / off:>7.3f}", flush=True)
    print(f"other processes kept {100 * meter.share()[1]:.0f}% of the CPUs busy meanwhile")


def constrained_step(runner: ModelRunner, args, greedy_s: float) -> None:
    """The same batch greedy with every row following ``bench_structured``'s JSON schema (its
    grammar compiled before timing): the constrained step cost."""
    import json

    from folio.core.structured.grammar import check_spec
    from folio.shared.messages import GuidedSpec
    from folio.bench.structured import SCHEMA

    grammar = check_spec(GuidedSpec(kind="json_schema", spec=json.dumps(SCHEMA)))
    runner.grammars.prepare(grammar).result()
    meter = CpuMeter()
    c = min(decode_steps(runner, 64, GREEDY, args.steps, None, grammar) for _ in range(args.repeats))
    print(f"SmolLM2 B=64 constrained (a JSON schema, every row): {c * 1e3:.1f} ms/step, ratio to greedy "
          f"{c / greedy_s:.3f}; other processes kept {100 * meter.share()[1]:.0f}% of the CPUs busy meanwhile",
          flush=True)


# the model shapes of the in-process step (config sizes): Llama-3.2-1B's, and a tiny one for the CPU
MODEL_SHAPES = {
    "1b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=1024),
}


def write_random_checkpoint(folder, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, **sizes) -> str:
    """A random-weight Llama (config.json + model.safetensors) drawn on ``device`` in ``dtype``: the 1B
    shape in seconds, where ``write_tiny_model``'s fp32 init and save take minutes. Projections and
    embeddings ~N(0, 0.02), norms ~N(1, 0.1)."""
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", rms_norm_eps=1e-5, tie_word_embeddings=False, **sizes)
    with torch.device("meta"):  # names and shapes only: nothing is allocated
        shapes = {name: p.shape for name, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator(device).manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        t = t * 0.02 if len(shape) > 1 else 1.0 + 0.1 * t
        state[name] = t.to(dtype).cpu()
    config.save_pretrained(folder)
    save_file(state, str(Path(folder) / "model.safetensors"))
    return str(folder)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_model_steps(args) -> None:
    """Decode steps of a random model in process (``--model-shape``; the 1B shape needs a GPU), eager
    and with CUDA graphs: tokens/s and ms per step at each of ``--batches``, each row also in ``--json``.
    A step's time is (a run of N + 1 tokens - a run of 1) / N, so the prefill cancels out."""
    from folio.core.engine import generate

    figures = {"shape": args.model_shape, "device": args.device, "rows": []}

    def save() -> None:  # after every row: a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)

    sizes = MODEL_SHAPES[args.model_shape]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    kinds = {"greedy": GREEDY, "sampled": SAMPLED}
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        path = write_random_checkpoint(folder, args.device, getattr(torch, dtype), **sizes)
        figures["checkpoint_s"] = time.perf_counter() - t0
        print(f"{args.model_shape} checkpoint written in {figures['checkpoint_s']:.1f} s", flush=True)
        for mode in args.modes:
            config = RuntimeConfig(device=args.device, dtype=dtype, max_num_seqs=max(args.batches),
                                   enforce_eager=mode == "eager")
            t0 = time.perf_counter()
            runner = ModelRunner(config, path)
            graphs = runner.graphs
            figures[f"{mode}_start_s"] = time.perf_counter() - t0
            print(f"{args.model_shape} {mode}: started in {figures[f'{mode}_start_s']:.1f} s; graphs of batches "
                  f"{graphs.buckets if graphs else 'none'}", flush=True)
            for batch in args.batches:
                prompts = [[(i * 7 + j) % sizes["vocab_size"] for j in range(args.prompt_len)] for i in range(batch)]
                for kind in args.kinds:
                    def once(n, p=kinds[kind]):
                        p = msgspec.structs.replace(p, max_tokens=n)
                        sync(runner.device)
                        t0 = time.perf_counter()
                        generate(runner, prompts, p)
                        sync(runner.device)
                        return time.perf_counter() - t0
                    once(2)
                    steps = args.decode_steps
                    dt = (once(steps + 1) - once(1)) / steps
                    replays = graphs.num_replays if graphs else 0
                    figures["rows"].append(dict(mode=mode, batch=batch, kind=kind, tok_s=batch / dt,
                                                ms_per_step=dt * 1e3, graph_replays=replays))
                    save()
                    print(f"{args.model_shape} {mode} B={batch} {kind}: {batch / dt:,.0f} tok/s, "
                          f"{dt * 1e3:.2f} ms/step, {replays} graph replays so far", flush=True)
            del runner
            if args.device == "cuda":
                torch.cuda.empty_cache()
    save()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs per case, greedy and sampled in turn; the fastest of each counts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", action="store_true", help="cProfile the B=256 steps")
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"],
                        help="the in-process model's steps eager, with CUDA graphs, or both")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                        help="the in-process model's shape (default: 1b with --device cuda, none on the CPU)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64, 256], help="the in-process model's batches")
    parser.add_argument("--kinds", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--decode-steps", type=int, default=64, help="the in-process model's timed decode steps")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--json", default=None, help="the in-process model's rows, written as each is measured")
    parser.add_argument("--skip-null", action="store_true", help="only the other cases (--smollm, the 1B shape)")
    parser.add_argument("--smollm", action="store_true",
                        help="also SmolLM2 at batch 64 on the CPU, greedy vs sampled vs constrained")
    parser.add_argument("--smollm-quantization", default="auto", help="its weights (auto: the packaged int4)")
    parser.add_argument("--batch-invariance", action="store_true",
                        help="also SmolLM2 with --batch-invariant and without, in turns (decode and prefill)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the step's small ops never wait on a busy core)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    greedy_256 = run_null(args) if not args.skip_null else float("nan")
    if args.smollm:
        run_smollm(args)
    if args.batch_invariance:
        run_invariance_cost(args)
    if args.model_shape is None and args.device == "cuda":
        args.model_shape = "1b"
    if args.model_shape is not None:
        with contextlib.suppress(KeyboardInterrupt):
            run_model_steps(args)
    print(f"host ms/step at B=256: {greedy_256:.3f}")


if __name__ == "__main__":
    main()

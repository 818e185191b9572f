"""Quality of quantized weights against the fp32 reference, on text the model itself writes.

The reference (``--quantization none``, fp32) samples continuations of varied prompts (seeded, so
the text is the same every run; cached under the folio cache folder). Then the reference and each
configuration teacher-force that text, and for every predicted position we compare the two
next-token distributions: mean KL(P_ref || P_q), how often the top-1 token agrees, and the ratio
of perplexities (quantized / reference) on the text.

Exits 1 when a configuration misses its target (see TARGETS), so CI can run it as a gate.

More in docs/modules.md (folio/bench/eval_quant.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import torch

from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.kernels.kv_quant import FP8_DTYPE
from folio.core.kv.tensors.calibration import calibrate_kv_scales, calibration_ids
from folio.core.executor.model.loader import load_model
from folio.core.executor.runtime.runner import make_backend
from folio.shared.config import DEFAULT_MODEL_NAME, batch_invariant_from_env, cache_dir
from folio.core.model_files import resolve_model

# (mean KLD at most, top-1 agreement at least), per kind of configuration: the figures of the issue
# that set the gate (issue 14's table: int4 1e-3 and 99%, int8 and the FP8 KV cache 5e-3 and 98%,
# AWQ 0.05 and 90%), never fitted to a run. ``int8-gptq`` is the label for a ``folio quantize
# --method int8`` folder (``int8-gptq=FOLDER``), ``int8`` the load-time one; both are int8.
# On SmolLM2-135M-Instruct the three 98% top-1 targets are missed on the 4,183-token text (2026-12-04
# and -05, 2-core Intel Xeon: int8 97.11%, int8-gptq 97.90%, kv-fp8 97.25%); GPTQ meets it on the
# full 10,327 tokens (98.47%). Every KLD target is met (docs/quantization.md has the figures).
TARGETS = {"int4": (1e-3, 0.99), "int8": (5e-3, 0.98), "int8-gptq": (5e-3, 0.98), "awq": (0.05, 0.90),
           "int4-g": (None, None), "kv-fp8": (5e-3, 0.98)}
PROMPTS = [
    "The history of the printing press", "def merge_sort(items):", "A recipe for a quick vegetable soup:",
    "Dear hiring manager,", "The three laws of thermodynamics say", "Once upon a time in a northern forest,",
    "Photosynthesis is the process", "Here is a short poem about the sea:", "The stock market fell today because",
    "To configure a home network router,", "The Roman empire expanded", "In machine learning, overfitting means",
    "My favourite board game is", "SELECT name, age FROM users WHERE", "The best way to learn a language is",
    "Volcanoes form when",
]


# how the reference samples its text (a change of either makes a new text, so a new cache entry)
TEMPERATURE, TOP_P = 0.8, 0.95


def model_tag(path: Path) -> str:
    return path.name.replace("/", "_")


def sampler_version() -> str:
    """A digest of the code that turns the reference's logits into tokens: the sampler, its seeded
    uniforms (Philox) and the C kernel that samples on the CPU. A change to any of them can change
    the seeded text, so it keys the cache."""
    from folio.core.executor import sampling
    from folio.core.executor.kernels import cpu_kernels

    files = sorted(Path(sampling.__file__).parent.glob("*.py")) + [cpu_kernels.CSRC / "sampler.c"]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def reference_key(path: Path, num_tokens: int, seed: int, batch_invariant: bool) -> str:
    """What the reference text depends on: the model (its files' names and sizes), the prompts and
    the sampling parameters, the sampler's code, whether the reference ran batch-invariant (its
    logits take other kernels, hence other tokens where two are close), torch's version and threads."""
    model_files = sorted((f.name, f.stat().st_size) for f in path.iterdir() if f.is_file())
    parts = {"model": model_files, "num_tokens": num_tokens, "seed": seed, "prompts": PROMPTS,
             "sampling": [TEMPERATURE, TOP_P], "sampler": sampler_version(), "batch_invariant": batch_invariant,
             "torch": torch.__version__, "threads": torch.get_num_threads()}
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def reference_text(model, tokenizer, path: Path, num_tokens: int, seed: int) -> list[list[int]]:
    """Seeded samples of the reference model continuing PROMPTS; about ``num_tokens`` in all; cached
    under the folio cache folder, keyed by everything that changes them (``reference_key``)."""
    batch_invariant = batch_invariant_from_env()
    key = reference_key(path, num_tokens, seed, batch_invariant)
    cache = cache_dir() / "eval" / f"{model_tag(path)}-{num_tokens}-{seed}-{key}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    from folio.core.engine import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.sampling import SamplingParams

    num_seqs = len(PROMPTS)
    new = math.ceil(num_tokens / num_seqs)
    runner = ModelRunner(RuntimeConfig(quantization="none", dtype="float32", device="cpu",
                                       num_kv_blocks=num_seqs * ((new + 64) // 16 + 2),
                                       batch_invariant=batch_invariant), str(path))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=new, ignore_eos=True, seed=seed + i)
              for i in range(num_seqs)]
    outs = generate(runner, prompts, params)
    seqs = [p + o for p, o in zip(prompts, outs)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(seqs))
    return seqs


@torch.inference_mode()
def log_probs(model, seq: list[int], block_size: int = 16, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Teacher-forced next-token log-probabilities ``[len(seq) - 1, vocab]`` (fp32); the KV pool
    holds ``kv_dtype`` (default: the model's dtype)."""
    n = len(seq)
    num_blocks = (n + block_size - 1) // block_size
    spec = model.spec
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    dtype = kv_dtype or model.embed_tokens.weight.dtype
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(spec.num_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], None, block_size)
    # the backend a server would run this model with (on the CPU: the C layer kernels for quantized weights)
    backend = make_backend("auto", torch.device("cpu"), model.embed_tokens.weight.dtype, kv_dtype, model)
    hidden = model(torch.tensor(seq), meta.positions, kv, meta, backend)
    return model.compute_logits(hidden[:-1]).log_softmax(-1)


def score(ref_lp: list[torch.Tensor], model, seqs: list[list[int]], kv_dtype: torch.dtype | None = None) -> dict:
    kl_sum = agree = nll_ref = nll_q = count = 0.0
    for seq, lp_ref in zip(seqs, ref_lp):
        lp = log_probs(model, seq, kv_dtype=kv_dtype)
        targets = torch.tensor(seq[1:]).unsqueeze(1)
        kl_sum += (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp(min=0).sum().item()
        agree += (lp_ref.argmax(-1) == lp.argmax(-1)).sum().item()
        nll_ref -= lp_ref.gather(1, targets).sum().item()
        nll_q -= lp.gather(1, targets).sum().item()
        count += len(seq) - 1
    return {"kld": kl_sum / count, "top1": agree / count, "ppl_ratio": math.exp((nll_q - nll_ref) / count),
            "ppl_ref": math.exp(nll_ref / count), "tokens": int(count)}


def load_config(name: str, default_path: Path):
    """(label, model, KV dtype or None): ``int4``, ``int4-g64``, ``int8``, ``auto`` on the default
    model; ``NAME=FOLDER`` for a folder; ``kv-fp8``: fp32 weights, an fp8 pool with calibrated scales."""
    if "=" in name:
        name, folder = name.split("=", 1)
        return name, load_model(Path(folder), torch.float32, torch.device("cpu"), "auto"), None
    if name == "kv-fp8":
        model = load_model(default_path, torch.float32, torch.device("cpu"), "none")
        calibrate_kv_scales(model, TorchAttentionBackend(), torch.device("cpu"), 16,
                            calibration_ids(str(default_path), model.spec.vocab_size))
        return name, model, FP8_DTYPE
    group = 32
    method = name
    if name.startswith("int4-g"):
        method, group = "int4", int(name.removeprefix("int4-g"))
    return name, load_model(default_path, torch.float32, torch.device("cpu"), method, group), None


def target_for(name: str, model) -> tuple[float | None, float | None]:
    kind = model.quantization if "=" not in name else name
    if name in TARGETS:
        return TARGETS[name]
    if name.startswith("int4-g"):
        return None, None  # a baseline (plain round to nearest), reported without a target
    return TARGETS.get(name.split("-")[0], TARGETS.get(kind, (None, None)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--configs", nargs="+", default=["int4", "int8"])
    parser.add_argument("--num-tokens", type=int, default=10240, help="teacher-forced tokens (at least)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--below", nargs=2, action="append", default=[], metavar=("A", "B"),
                        help="also require config A's KLD to be below config B's (e.g. awq int4-g64)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from folio.bench.cpu_meter import CpuMeter

    path = resolve_model(args.model)
    meter = CpuMeter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = load_model(path, torch.float32, torch.device("cpu"), "none")
    seqs = reference_text(reference, tokenizer, path, args.num_tokens, args.seed)
    ref_lp = [log_probs(reference, s) for s in seqs]
    del reference
    print(f"model={path.name} reference=fp32 (--quantization none) text={sum(len(s) - 1 for s in seqs)} tokens "
          f"in {len(seqs)} sampled sequences")
    print("| config | served as | mean KLD | top-1 agree | PPL ratio | target | |")
    print("|---|---|---|---|---|---|---|")
    results, failed = {}, []
    for name in args.configs:
        label, model, kv_dtype = load_config(name, path)
        r = score(ref_lp, model, seqs, kv_dtype)
        results[label] = r
        max_kld, min_top1 = target_for(label, model)
        ok = (max_kld is None or r["kld"] <= max_kld) and (min_top1 is None or r["top1"] >= min_top1)
        target = "—" if max_kld is None else f"KLD <= {max_kld:g}, top-1 >= {min_top1:.1%}"
        if not ok:
            failed.append(label)
        served = model.quantization + (" (fp8 KV)" if kv_dtype is not None else "")
        print(f"| {label} | {served} | {r['kld']:.2e} | {r['top1']:.2%} | {r['ppl_ratio']:.4f} | "
              f"{target} | {'ok' if ok else 'MISSED'} |", flush=True)
        del model
    for a, b in args.below:
        ok = results[a]["kld"] < results[b]["kld"]
        print(f"KLD {a} < {b}: {results[a]['kld']:.2e} < {results[b]['kld']:.2e} {'ok' if ok else 'MISSED'}")
        if not ok:
            failed.append(f"{a}<{b}")
    print(f"reference perplexity {next(iter(results.values()))['ppl_ref']:.3f}; {meter.lap()}")
    if failed:
        print(f"targets missed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

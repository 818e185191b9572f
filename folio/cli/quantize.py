"""``folio quantize --method awq|int4|int8 MODEL OUT``: write a quantized model folder folio loads.

- ``awq``: AWQ (``awq.py``) calibrated on the model's own sampled continuations of varied prompts
  (seeded), written in AutoAWQ's GEMM layout (``qweight [in, out/8]``, ``qzeros [in/g, out/8]``
  int32, ``scales [in/g, out]`` fp16, nibble order 0, 2, 4, 6, 1, 3, 5, 7) with the
  ``quantization_config`` transformers writes for AWQ;
- ``int4``: the same layout, plain round to nearest (no calibration);
- ``int8``: per-channel symmetric int8 (``weight`` int8 + ``weight_scale`` fp32), folio's own
  ``quant_method`` ``folio-int8``, its rounding errors compensated by GPTQ (``gptq.py``) on the same
  calibration text as AWQ; ``--rtn`` rounds to nearest instead, as ``--quantization int8`` does
  at load time.

Everything that is not a decoder projection (embeddings, norms, the LM head) stays dense. The tool
rewrites Llama-shaped checkpoints (``QUANTIZABLE_MODEL_TYPES``); it refuses other families, which
quantize at load time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from folio.core.executor.quant.formats import FOLIO_INT8, int4_to_awq, quantize_int8

CALIBRATION_PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how vaccines train the immune system.",
    "import numpy as np\n\ndef normalize(x):", "The causes of the French Revolution include",
    "List five tips for staying productive while working from home:", "Translate to French: good morning, friends.",
    "The difference between TCP and UDP is", "A haiku about autumn leaves:",
]
MAX_CONTINUATION = 256


def calibration_text(path: Path, num_tokens: int, seed: int) -> list[list[int]]:
    """The model's own sampled continuations (temperature 1, seeded) of CALIBRATION_PROMPTS, about
    ``num_tokens`` new tokens in all."""
    from transformers import AutoTokenizer

    from folio.core.executor.model.loader import load_hf_config
    from folio.core.engine import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.sampling import SamplingParams

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer.encode(p) for p in CALIBRATION_PROMPTS]
    except (OSError, ValueError):  # a folder without a tokenizer: seeded random prompts
        vocab = load_hf_config(path).vocab_size
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(vocab, (8,), generator=gen).tolist() for _ in CALIBRATION_PROMPTS]
    # at most MAX_CONTINUATION new tokens a sequence: more tokens are more samples, cycling the prompts
    count = max(len(prompts), -(-num_tokens // MAX_CONTINUATION))
    prompts = [prompts[i % len(prompts)] for i in range(count)]
    new = max(1, num_tokens // count)
    blocks = count * ((max(map(len, prompts)) + new) // 16 + 2)
    runner = ModelRunner(RuntimeConfig(quantization="none", dtype="float32", device="cpu", num_kv_blocks=blocks),
                         str(path))
    params = [SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, seed=seed + i)
              for i in range(count)]
    outs = generate(runner, prompts, params)
    return [p + o for p, o in zip(prompts, outs)]


def _copy_side_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config",
                                              "vocab", "merges")):
            shutil.copy(f, out / f.name)


# the families whose checkpoints this tool rewrites: separate q/k/v and gate/up projections, plain
# RMSNorm weights (AWQ folds its scales into them) and one MLP per layer. Every other family
# (Gemma's (1 + w) norms, Phi-3's fused projections, experts) quantizes at load time instead.
QUANTIZABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_quantizable(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in QUANTIZABLE_MODEL_TYPES:
        raise ValueError(f"folio quantize writes {', '.join(QUANTIZABLE_MODEL_TYPES)} checkpoints, not "
                         f"{model_type!r}; serve it with --quantization int8 or int4 (quantized at load) instead")


def quantize(model_path: Path, out: Path, method: str, group_size: int, num_tokens: int, seed: int,
             quiet: bool = False, rtn: bool = False) -> Path:
    from safetensors.torch import save_file
    from tqdm import tqdm

    from folio.cli.awq import awq_quantize
    from folio.cli.gptq import gptq_int8
    from folio.core.executor.model.loader import load_hf_config, load_model, read_checkpoint

    if method not in ("awq", "int4", "int8"):
        raise ValueError(f"unknown method {method!r}; choose awq, int4 or int8")
    if model_path.suffix == ".gguf" or not (model_path / "config.json").exists():
        raise ValueError(f"{model_path} is not a model folder (config.json + safetensors)")
    config, state, checkpoint_method, _ = read_checkpoint(model_path)
    check_quantizable(config)
    if checkpoint_method not in ("none", "int4"):  # int4: a prepared GGUF folder, its dense weights are exact
        raise ValueError(f"{model_path} is quantized already ({checkpoint_method})")
    linears = sorted(n for n in state if n.endswith("_proj.weight") and ".layers." in n)
    out_state = {n: t for n, t in state.items() if n not in linears}
    if method == "int8":
        if rtn:
            quant8 = {name: quantize_int8(state[name]) for name in tqdm(linears, desc="int8", unit="tensor",
                                                                        disable=quiet)}
        else:
            model = load_model(model_path, torch.float32, torch.device("cpu"), "none")
            seqs = calibration_text(model_path, num_tokens, seed)
            with tqdm(total=model.spec.num_layers, desc="int8 (gptq)", unit="layer", disable=quiet) as bar:
                quant8 = gptq_int8(model, seqs, progress=lambda: bar.update(1))
        for name, w in quant8.items():
            out_state[name], out_state[name + "_scale"] = w.q, w.scale
        qconfig = {"quant_method": FOLIO_INT8, "bits": 8, "group_size": -1, "symmetric": True}
    else:
        model = load_model(model_path, torch.float32, torch.device("cpu"), "none")
        seqs = calibration_text(model_path, num_tokens, seed) if method == "awq" else []
        with tqdm(total=model.spec.num_layers, desc=method, unit="layer", disable=quiet) as bar:
            quant, changed = awq_quantize(model, seqs, group_size, search=method == "awq",
                                          progress=lambda: bar.update(1))
        out_state.update(changed)
        for name, w in quant.items():
            base = name[: -len(".weight")]
            out_state.pop(name, None)
            out_state.update({f"{base}.{k}": v for k, v in int4_to_awq(w).items()})
        qconfig = _awq_config(group_size)
    if getattr(config, "tie_word_embeddings", False):
        out_state.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    raw = load_hf_config(model_path).to_dict()
    raw["quantization_config"] = qconfig
    type(config).from_dict(raw).save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in out_state.items()}, tmp / "model.safetensors")
    _copy_side_files(model_path, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _awq_config(group_size: int) -> dict:
    """What transformers writes for an AutoAWQ GEMM checkpoint."""
    from transformers import AwqConfig

    cfg = AwqConfig(bits=4, group_size=group_size, zero_point=True, version="gemm", sym=False).to_dict()
    return {k: (v.value if hasattr(v, "value") else v) for k, v in cfg.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="folio quantize", description=__doc__.splitlines()[0])
    parser.add_argument("--method", required=True, choices=["awq", "int4", "int8"])
    parser.add_argument("--group-size", type=int, default=64, help="int4/awq: input channels per scale (32, 64, 128)")
    parser.add_argument("--calibration-tokens", type=int, default=2048,
                        help="awq, int8: sampled tokens to calibrate on")
    parser.add_argument("--rtn", action="store_true", help="int8: round to nearest, no calibration (no GPTQ)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("model", help="the default model's name or a model folder")
    parser.add_argument("out", help="the folder to write")
    args = parser.parse_args(argv)
    from folio.core.model_files import resolve_model

    try:
        path = quantize(resolve_model(args.model), Path(args.out), args.method, args.group_size,
                        args.calibration_tokens, args.seed, rtn=args.rtn)
    except (ValueError, FileNotFoundError) as exc:
        print(f"folio quantize: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

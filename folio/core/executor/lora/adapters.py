"""PEFT LoRA adapters, read and checked against the model they will run on.

An adapter is a folder as ``peft`` saves it: ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, optional ``rank_pattern``/``alpha_pattern``) and ``adapter_model.safetensors``
with ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` for each target. Targets are any of the q/k/v/o attention and
gate/up/down MLP projections. A module's delta is ``scale * B (A x)`` with ``scale = alpha / r``
(``alpha / sqrt(r)`` with rsLoRA).

More in docs/modules.md (folio/core/executor/lora/adapters.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# a checkpoint projection -> (our fused projection, its part index)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served, with the reason."""


@dataclass(frozen=True)
class Projection:
    """One fused projection of one layer: its input size and each part's (row offset, rows)."""

    in_features: int
    parts: tuple[tuple[int, int], ...]

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.parts)


def projection_layout(spec_or_model) -> list[dict[str, Projection]]:
    """Per layer, the projections an adapter may target (an MoE layer has no dense MLP ones).
    Takes a ``CausalLM`` (its modules' sizes) or a ``ModelSpec`` (a single-rank model's)."""
    layers = getattr(spec_or_model, "layers", None)
    if layers is not None and not isinstance(layers, int):
        spec = spec_or_model.spec
        out = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            hidden = spec.hidden_size
            proj = {"qkv_proj": Projection(hidden, ((0, attn.q_size), (attn.q_size, attn.kv_size),
                                                    (attn.q_size + attn.kv_size, attn.kv_size))),
                    "o_proj": Projection(attn.q_size, ((0, hidden),))}
            inter = getattr(mlp, "intermediate_size", None)
            if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj") and inter:
                proj["gate_up_proj"] = Projection(hidden, ((0, inter), (inter, inter)))
                proj["down_proj"] = Projection(inter, ((0, hidden),))
            out.append(proj)
        return out
    spec = spec_or_model
    q, kv, hidden, inter = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size,
                            spec.intermediate_size)
    out = []
    for i in range(spec.num_layers):
        proj = {"qkv_proj": Projection(hidden, ((0, q), (q, kv), (q + kv, kv))), "o_proj": Projection(q, ((0, hidden),))}
        moe = spec.num_experts and (not spec.moe_layers or spec.moe_layers[i])
        if not moe:
            proj["gate_up_proj"] = Projection(hidden, ((0, inter), (inter, inter)))
            proj["down_proj"] = Projection(inter, ((0, hidden),))
        out.append(proj)
    return out


@dataclass
class LoRAAdapter:
    """An adapter on the host: ``modules[(layer, projection)][part] = (A [r, in], B [out_part, r])``
    in fp32, each B already multiplied by its module's scale over ``scaling`` (they differ only
    with ``rank_pattern``/``alpha_pattern``), so that every module's delta is ``scaling * B (A x)``."""

    name: str
    path: str
    rank: int  # the largest rank of any module
    scaling: float
    modules: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def width(self, layer: int, projection: str) -> int:
        """The stacked rank of a fused projection (its parts' ranks summed)."""
        return sum(a.shape[0] for a, _ in self.modules.get((layer, projection), {}).values())

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for parts in self.modules.values() for a, b in parts.values())


def _pattern_value(pattern: dict, key: str, default):
    """peft's rule: the first pattern that matches the module's name (as a full-name suffix)."""
    for pat, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return value
    return default


def load_peft_adapter(path, spec_or_model, max_rank: int, name: str | None = None) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the model (see the module docstring); raises
    ``LoRAError`` saying why it cannot be served."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter path {str(path)!r} is not a folder")
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    if not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {str(path)!r}: adapter_config.json is not JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {str(path)!r} is a {config.get('peft_type')} adapter, not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True), ("lora_bias", True)):
        if config.get(key) == bad:
            raise LoRAError(f"LoRA adapter {str(path)!r}: {key} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {str(path)!r}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {str(path)!r}: modules_to_save ({config['modules_to_save']}) is not supported")
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))

    def scale_of(rank: int, a: float) -> float:
        return a / math.sqrt(rank) if rslora else a / rank

    layout = projection_layout(spec_or_model)
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file), device="cpu")
    except Exception as exc:  # a truncated or foreign file
        raise LoRAError(f"LoRA adapter {str(path)!r}: cannot read adapter_model.safetensors ({exc})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGETS:
            raise LoRAError(f"LoRA adapter {str(path)!r}: unsupported target {key!r} (folio applies adapters to "
                            f"the q/k/v/o and gate/up/down projections only)")
        layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        fused, part = TARGETS[module]
        if PARENT[fused] != parent or layer >= len(layout) or fused not in layout[layer]:
            raise LoRAError(f"LoRA adapter {str(path)!r}: the model has no projection for {key!r}")
        pairs.setdefault((layer, module), {})[ab] = tensor
    if not pairs:
        raise LoRAError(f"LoRA adapter {str(path)!r} has no LoRA weights")
    adapter = LoRAAdapter(name=name or folder.name, path=str(path), rank=0, scaling=scale_of(r, alpha))
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {str(path)!r}: {where} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"].float(), ab["B"].float()
        fused, part = TARGETS[module]
        proj = layout[layer][fused]
        rows = proj.parts[part][1]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != proj.in_features or b.shape != (rows, rank):
            raise LoRAError(f"LoRA adapter {str(path)!r}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                            f"the model needs A [r, {proj.in_features}] and B [{rows}, r] (an adapter for another model?)")
        if rank > max_rank:
            raise LoRAError(f"LoRA adapter {str(path)!r} has rank {rank} ({where}), above max_lora_rank {max_rank}")
        full = f"model.layers.{layer}.{PARENT[fused]}.{module}"
        module_rank = _pattern_value(config.get("rank_pattern"), full, r)
        if module_rank != rank:
            raise LoRAError(f"LoRA adapter {str(path)!r}: {where} has rank {rank}, its config says {module_rank}")
        scale = scale_of(rank, float(_pattern_value(config.get("alpha_pattern"), full, alpha)))
        if scale != adapter.scaling:
            b = b * (scale / adapter.scaling)
        adapter.modules.setdefault((layer, fused), {})[part] = (a.contiguous(), b.contiguous())
        adapter.rank = max(adapter.rank, rank)
    return adapter

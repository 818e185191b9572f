"""Loading one rank's shard of a model for tensor parallelism (``loader.load_model`` calls it).

From a safetensors folder each rank reads only its slices: ``safe_open(...).get_slice(name)``
memory-maps the file and copies only the rows or columns asked for, so no rank ever holds the
whole model. A GGUF file is read the same way (``gguf_slices.py``, every GGUF architecture the
unsharded loader reads): each rank takes its slice of the quantized blocks from the memory-mapped
file and dequantizes only that. Which slices make
each parameter is the model family's ``checkpoint_layout`` (``model/layers.py``) at this shard.

Quantized weights are not sharded yet: ``--quantization auto`` serves the dense weights (a
prepared folder holds them), any other method than ``none`` is refused with a message.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

from folio.core.executor.model.gguf_slices import GGUFSlices
from folio.core.executor.model.configs import load_hf_config
from folio.core.executor.model.layers import CausalLM
from folio.core.executor.model.registry import build_model, check_runtime, model_spec
from folio.core.executor.parallel.comm import Comm, Shard, check_shardable
from folio.core.executor.quant.formats import folder_quant_config

class SafetensorsSlices:
    """Reads slices of named tensors from a folder's safetensors files, memory-mapped."""

    def __init__(self, folder: Path, stack: ExitStack):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        files = sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.exists() \
            else sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self.where = {}
        for name in files:
            handle = stack.enter_context(safe_open(folder / name, framework="pt"))
            self.where.update({key: handle for key in handle.keys()})

    def read(self, name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"checkpoint lacks {name}")
        handle = self.where[name]
        if dim is None:
            return handle.get_tensor(name)
        piece = handle.get_slice(name)
        return piece[start:end] if dim == 0 else piece[:, start:end]


def _check_quantization(quantization: str, path: Path) -> None:
    if quantization not in ("auto", "none"):
        raise ValueError(f"--quantization {quantization} does not shard yet: with --tensor-parallel-size > 1 "
                         "use none (or auto, which serves the dense weights)")
    kind = (folder_quant_config(path) or {}).get("quant_method") if path.is_dir() else None
    if kind is not None:
        raise ValueError(f"a {kind} checkpoint does not shard yet: with --tensor-parallel-size > 1 serve "
                         "a dense model folder")


def load_sharded(path: Path, dtype: torch.dtype, device: torch.device, quantization: str, shard: Shard,
                 comm: Comm | None) -> CausalLM:
    """This rank's shard of the model at ``path``, in ``dtype`` on ``device``."""
    _check_quantization(quantization, path)
    with ExitStack() as stack:
        if path.suffix == ".gguf":
            reader = GGUFSlices(path)  # the config rebuilt from the file's metadata
            config = reader.config
        else:
            config = load_hf_config(path)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            reader = SafetensorsSlices(path, stack)
        spec = model_spec(config)
        check_runtime(spec, device=device.type, tp_size=shard.size)
        check_shardable(spec, shard)
        with torch.device("meta"):
            model = build_model(spec, config, shard, comm)
        rows = model.embed_tokens.weight.shape[0]
        shapes = {name: t.shape for name, t in model.state_dict().items()}
        weights = {}
        # the family's checkpoint layout at this shard: our names -> the slices concatenated into them
        for name, parts in type(model).checkpoint_layout(spec, shard).items():
            tensor = torch.cat([reader.read(*part) for part in parts], dim=0).to(dtype)
            if name in ("embed_tokens.weight", "lm_head.weight") and tensor.shape[0] < rows:
                tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], tensor.shape[1])])
            weights[name] = tensor.reshape(shapes[name])
    model.load_state_dict(weights, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.init_rope(dtype, device)
    model.quantization = "none"
    return model

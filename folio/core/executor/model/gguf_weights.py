"""A GGUF model served in its own types on the CPU: each quantized projection, the embedding table
and the LM head are repacked losslessly into the kernels' tiles (``quant/cpu_gemm.py``), tensor by
tensor from the memory-mapped file; the rest (norms, biases, routers, experts) is read dense.

A mixed file (Q4_K_M: Q4_K with Q6_K for some tensors) keeps each tensor's type; a fused q/k/v of
two types is one weight of two parts. A projection in a type the kernels do not read (Q2_K, Q3_K,
the IQ2/IQ3 families) is rounded to Q8_0 blocks from its values, with a warning. ``loader.py``
calls ``load_gguf_native`` for ``--quantization auto`` (and ``int4`` / ``int8`` when the file is
all Q4_0/Q4_1 / all Q8_0) on the CPU.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import structlog
import torch

from folio.core.executor.model.gguf_slices import GGUFSlices
from folio.core.executor.model.layers import PACKED_PROJECTIONS, CausalLM
from folio.core.executor.model.registry import build_model, check_runtime, model_spec
from folio.core.executor.quant import cpu_gemm
from folio.core.executor.quant.linear import QuantEmbedding, quant_layers_available, quantize_model

log = structlog.get_logger()
INT4_TYPES = {"Q4_0", "Q4_1"}
FLOAT_TYPES = ("F32", "F16", "BF16")


def _takes(requested: str, kinds: set[str]) -> bool:
    """Whether ``--quantization requested`` is served by the file's own types."""
    if requested == "auto":
        return True
    return (requested == "int4" and kinds <= INT4_TYPES) or (requested == "int8" and kinds == {"Q8_0"})


def _method(kinds: set[str]) -> str:
    """What the model's ``quantization`` says: int4 / int8 for files of those types alone, else gguf."""
    return "int4" if kinds <= INT4_TYPES else "int8" if kinds == {"Q8_0"} else "gguf"


def _progress(total: int, path: Path):
    from tqdm import tqdm

    # shown on a terminal only (a first load of a large file takes seconds)
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"repacking {path.name}", disable=None, leave=False)


class _Packer:
    """The file's tensors as tiles, parts of fused projections included."""

    def __init__(self, reader: GGUFSlices):
        self.reader = reader
        self.units = cpu_gemm.UNITS
        self.types: Counter = Counter()

    def native(self, name: str) -> bool:
        return self.reader.native_type(name, self.units) is not None

    def quantized(self, name: str) -> bool:
        return name in self.reader.tensors and self.reader.tensors[name][0].tensor_type.name not in FLOAT_TYPES

    def part(self, name: str, dim: int | None, start: int, end: int) -> cpu_gemm.PackedWeight:
        """One part of a projection: its blocks repacked, or, in a type no kernel reads, its values
        rounded to Q8_0 blocks."""
        kind = self.reader.native_type(name, self.units)
        if kind is None:
            return self.rounded(name, self.reader.read(name, dim, start, end))
        raw, order, k = self.reader.raw_rows(name, start, end if dim == 0 else None)
        if dim == 1 and (start, end) != (0, k):
            raise ValueError(f"{name}: columns {start}:{end} of a quantized tensor (whole rows only)")
        self.types[kind] += 1
        return cpu_gemm.PackedWeight.from_gguf(kind, raw, k, None if order is None else order.numpy())

    def rounded(self, name: str, dense: torch.Tensor) -> cpu_gemm.PackedWeight:
        kind = self.reader.tensors[name][0].tensor_type.name if name in self.reader.tensors else "?"
        log.warning("no kernel reads this GGUF type: rounded to Q8_0 blocks", tensor=name, type=kind)
        self.types["Q8_0"] += 1
        return cpu_gemm.PackedWeight.from_int8(*cpu_gemm.int8_blocks(dense.float()))


def load_gguf_native(path: Path, config=None, requested: str = "auto") -> CausalLM | None:
    """The model of GGUF file ``path`` with its quantized tensors in their own types, or None when
    ``requested`` asks for something else (or the kernels cannot be built here): the caller then
    loads it dense. ``config``: the checkpoint's, when a prepared folder gives it."""
    if not cpu_gemm.available() or not quant_layers_available():
        return None
    reader = GGUFSlices(path, config)
    kinds = reader.linear_types()
    if not kinds or not (kinds & set(cpu_gemm.TYPES)) or not _takes(requested, kinds):
        return None
    spec = model_spec(reader.config)
    check_runtime(spec, device="cpu", quantization="int4")
    with torch.device("meta"):
        model = build_model(spec, reader.config)
    layout = type(model).checkpoint_layout(spec)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    packer = _Packer(reader)
    packed: dict[str, cpu_gemm.PackedWeight] = {}
    dense: dict[str, torch.Tensor] = {}
    total, seen = sum(int(t.n_bytes) for t in reader.reader.tensors), set()
    with _progress(total, path) as bar:
        for name, parts in layout.items():
            module, _, leaf = name.rpartition(".")
            quantized = leaf == "weight" and (module.rpartition(".")[2] in PACKED_PROJECTIONS
                                              or module in ("embed_tokens", "lm_head"))
            if quantized and any(packer.native(p[0]) for p in parts):
                packed[module] = cpu_gemm.PackedWeight.cat([packer.part(*p) for p in parts])
            else:
                tensors = [reader.read(*p) for p in parts]
                value = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).reshape(shapes[name])
                if quantized and module not in ("embed_tokens", "lm_head") and any(packer.quantized(p[0]) for p in parts):
                    packed[module] = packer.rounded(parts[0][0], value)
                else:
                    dense[name] = value
            for t in {reader.tensors[p[0]][0].name: reader.tensors[p[0]][0] for p in parts}.values():
                reader.reader.release(t)  # read once: its mapped pages need not stay resident
                if t.name not in seen:
                    seen.add(t.name)
                    bar.update(int(t.n_bytes))
    model.load_state_dict(dense, strict=False, assign=True)
    embed = packed.pop("embed_tokens", None)
    head = packed.pop("lm_head", None)
    if embed is not None:
        model.embed_tokens = QuantEmbedding(embed)
        if spec.tie_word_embeddings:
            head = embed
    quantize_model(model, packed, "int4", 32, head=head)
    _check_loaded(model)
    model = model.to(dtype=torch.float32).eval().requires_grad_(False)
    model.init_rope(torch.float32, torch.device("cpu"))
    model.quantization = _method(kinds)
    model.weight_types = dict(packer.types)
    log.info("GGUF weights served in their own types", path=str(path), types=dict(packer.types),
             method=model.quantization)
    return model


def _check_loaded(model: CausalLM) -> None:
    """Every parameter and buffer has its values (none left on the meta device)."""
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"the GGUF file gave no values for {', '.join(left[:5])}")


def weight_summary(model) -> str:
    """The weights' types, for the log: e.g. ``Q4_K x113, Q6_K x17``."""
    types = getattr(model, "weight_types", None) or {}
    return ", ".join(f"{k} x{v}" for k, v in sorted(types.items(), key=lambda kv: -kv[1])) or "-"

"""Weight loading: a Hugging Face folder (config.json + safetensors) or a GGUF file.

The executor's runtime calls ``load_model``; ``folio/core/model_files.py`` uses ``load_gguf_state`` to turn the
packaged GGUF into a model folder once. A GGUF file is read by ``gguf_slices.py`` (every architecture
llama.cpp writes that a family here runs: its config rebuilt from the metadata, its tensors under
their HF names). A checkpoint's own quantization (GGUF Q4_0/Q4_1/Q8_0, an AWQ folder, folio's int8
folders, or the GGUF a prepared folder came from) is read through ``gguf_slices.py`` and
``quant/formats.py`` and served as it is unless ``--quantization`` says otherwise.
On the CPU a quantized model, once built (its int4/int8 weights repacked for the kernels), is kept
in the folio cache (``prepared/``) and later starts map it back from there (``torch.load(mmap=True)``:
the default model in 0.1 s instead of 20 s). The entry's key hashes each input file's path, size and
modification time, the loading code's source, torch's version, the dtype, the method and the group
size, so a changed checkpoint or a new folio builds a new entry; ``FOLIO_MODEL_CACHE=0`` turns it
off; the newest ``PREPARED_KEEP`` entries are kept, and a model that builds in under
``PREPARED_MIN_BUILD_S`` gets none.
The model's family (``registry.py``) builds the modules, and its ``checkpoint_layout`` maps
checkpoint names onto ours: q/k/v and gate/up are concatenated into the fused projections,
experts are stacked, and the ``model.`` prefix goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import structlog
import torch

from folio.core.executor.model.configs import load_hf_config  # noqa: F401  (the loader's callers name it here)
from folio.core.executor.model.gguf_slices import read_gguf
from folio.core.executor.model.gguf_weights import load_gguf_native
from folio.core.executor.model.layers import PACKED_PROJECTIONS, CausalLM, ModelSpec, Part
from folio.core.executor.model.registry import build_model, check_runtime, family_for, model_spec
from folio.core.executor.parallel.comm import Comm, Shard
from folio.core.executor.quant.formats import (
    FOLIO_INT8, QUANT_METHODS, Int4Weight, Int8Weight, concat_rows, folder_quant_config, on_awq_grid,
    quantize_int4, quantize_int8, read_awq_state, read_gguf_quant, read_int8_state,
)
from folio.core.executor.quant.gpu import quantize_model_gpu, require_fp8
from folio.core.executor.quant.linear import quantize_model
from folio.core.executor import startup
from folio.shared.config import cache_dir

log = structlog.get_logger()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is fp32 on the CPU (exactness, and CPU half GEMMs are slow) and bf16 on a GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


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


def remap_state_dict(state: dict[str, torch.Tensor], layout: dict[str, list[Part]],
                     shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> ours, by the family's ``checkpoint_layout``: each of our tensors is
    its parts concatenated along rows (fused qkv and gate_up, stacked experts), in our shape."""

    def take(name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"checkpoint lacks {name}")
        t = state[name]
        return t if dim is None else t[start:end] if dim == 0 else t[:, start:end]

    out: dict[str, torch.Tensor] = {}
    for name, parts in layout.items():
        tensor = take(*parts[0]) if len(parts) == 1 else torch.cat([take(*p) for p in parts], dim=0)
        out[name] = tensor.reshape(shapes[name])
    return out


def read_checkpoint(path: Path) -> tuple[object, dict[str, torch.Tensor], str, dict]:
    """(config, dense HF-named state, the checkpoint's own quantization, its quantized linears).

    Quantized linears are also dequantized into the dense state, so ``--quantization none`` (and
    everything that is not a projection) always has its weights."""
    if path.suffix == ".gguf":
        return read_gguf(path)
    config = load_hf_config(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers would try to quantize on its own
    state = read_safetensors(path)
    qconfig = folder_quant_config(path) or {}
    kind = qconfig.get("quant_method")
    if kind == "awq":
        if qconfig.get("bits", 4) != 4 or qconfig.get("version", "gemm").lower() != "gemm":
            raise ValueError(f"only 4-bit AWQ in the GEMM layout is supported, not {qconfig}")
        quant = read_awq_state(state, int(qconfig["group_size"]))
        method = "awq"
    elif kind == FOLIO_INT8:
        quant, method = read_int8_state(state), "int8"
    elif kind is not None:
        raise ValueError(f"unsupported quantization_config quant_method {kind!r} (awq and {FOLIO_INT8} load)")
    else:
        source = prepared_source(path)
        method, quant = read_gguf_quant(source, config) if source else ("none", {})
    for name, w in quant.items():
        base = name[: -len(".weight")]
        for suffix in (".qweight", ".qzeros", ".scales", ".weight_scale"):
            state.pop(base + suffix, None)
        if name not in state or not state[name].is_floating_point():
            state[name] = w.dequantize()  # a prepared folder has these already (the same values)
    state = family_for(config).checkpoint_state(state)
    return config, base_model_as_causal_lm(config, state), method, quant


def base_model_as_causal_lm(config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder saved without its LM head (``Qwen3Model``: an embedding model such as
    Qwen3-Embedding, its names without ``model.``) read as its causal LM: the names prefixed, and
    the embeddings standing in as the head (tied), which only a score over logits would read."""
    if "embed_tokens.weight" not in state or any(k.startswith("model.") for k in state):
        return state
    config.tie_word_embeddings = True
    return {f"model.{k}": v for k, v in state.items()}


def prepared_source(folder: Path) -> Path | None:
    """The GGUF a prepared folder was dequantized from, when it is still there."""
    from folio.core.model_files import MARKER, default_model_dir, packaged_gguf

    marker = folder / MARKER
    if not marker.exists():
        return None
    source = json.loads(marker.read_text()).get("source") or ""
    if source.endswith(".gguf") and Path(source).exists():
        return Path(source)
    if folder.resolve() == default_model_dir().resolve():  # prepared by another install of the package
        try:
            return packaged_gguf()
        except FileNotFoundError:
            return None
    return None


def _quant_part(w, dim: int | None, start: int, end: int):
    """One checkpoint part of a fused projection, quantized: rows ``start:end`` (dim 0), or the whole
    weight (quantized weights are not sharded, so a dim-1 part spans every column)."""
    if dim is None or (dim == 1 and start == 0 and end == w.q.shape[1]):
        return w
    if dim != 0:
        raise ValueError("quantized weights are taken by whole rows only (they do not shard)")
    if isinstance(w, Int4Weight):
        return Int4Weight(w.q[start:end], w.scale[start:end], w.zero[start:end], w.group_size)
    return Int8Weight(w.q[start:end], w.scale[start:end])


def _fused_quant_weights(state, quant, spec: ModelSpec, method: str, group_size: int, awq_grid: bool = False,
                         layout: dict[str, list[Part]] | None = None) -> dict:
    """Our fused projection names (``layers.PACKED_PROJECTIONS``: attention, dense MLPs, a shared
    expert) -> their int4/int8 weights, made of the parts the family's ``checkpoint_layout`` names
    (Phi-3's fused checkpoint tensors too). Each part is taken from the checkpoint when it holds it
    in the wanted form, else rounded to nearest from the dense weights. ``awq_grid`` (the GPU
    kernel): int4 weights must have integer zero points; others (Q4_0/Q4_1) are re-rounded. Routed
    experts are not here (``moe.MoE.quantize_experts``). ``layout``: the model's, else its family's
    by ``spec.model_type``."""
    if layout is None:
        layout = family_for(SimpleNamespace(model_type=spec.model_type)).checkpoint_layout(spec)
    whole: dict[str, object] = {}

    def one(name: str):
        if name in whole:
            return whole[name]
        w = quant.get(name)
        if method in ("int4", "awq") and isinstance(w, Int4Weight) and (not awq_grid or on_awq_grid(w)):
            pass
        elif method == "int8" and isinstance(w, Int8Weight):
            pass
        elif method == "awq":
            raise ValueError("--quantization awq needs an AWQ checkpoint; make one with folio quantize --method awq")
        else:
            dense = state[name]
            w = quantize_int8(dense) if method == "int8" else quantize_int4(dense, group_size)
        whole[name] = w
        return w

    out = {}
    for name, parts in layout.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in PACKED_PROJECTIONS:
            continue
        pieces = [_quant_part(one(p[0]), *p[1:]) for p in parts]
        out[module] = pieces[0] if len(pieces) == 1 else concat_rows(pieces)
    return out


GPU_METHODS = ("none", "awq", "int4", "fp8")


def resolve_quantization(requested: str, checkpoint: str, device: torch.device) -> str:
    """``auto`` keeps the checkpoint's own quantization; the rest are checked against the device.

    On a CUDA GPU: ``awq`` and ``int4`` run the W4A16 kernel, ``fp8`` needs sm_89+; ``auto``
    serves an AWQ folder as ``awq`` and anything else dense (a Q4_1 GGUF's zero points are not
    on the kernel's integer grid; int8 has no GPU kernel). On the CPU every method but fp8."""
    if requested not in QUANT_METHODS:
        raise ValueError(f"unknown quantization {requested!r}; choose one of {', '.join(QUANT_METHODS)}")
    method = checkpoint if requested == "auto" else requested
    if requested == "auto" and device.type != "cpu" and method != "awq":
        method = "none"
    if method == "fp8":
        require_fp8(device)
    if method != "none" and device.type != "cpu" and (device.type != "cuda" or method not in GPU_METHODS):
        raise ValueError(f"--quantization {method} has no kernel on {device.type} in this build; on a CUDA GPU "
                         f"use one of {', '.join(GPU_METHODS)}")
    return method


@contextmanager
def no_random_init():
    """Modules built while a model loads skip their random initialisation (``torch.nn.init``'s
    in-place functions leave the tensor as it is): every weight is loaded over it. The modules are
    built on the meta device, where an init runs through torch's Python references; the first such
    call imports ``torch._dynamo``, which imports triton when it is installed, whose bindings then
    print hundreds of "nanobind: leaked ..." lines when the process exits. folio never uses either."""
    from torch.nn import init

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    for n in names:
        setattr(init, n, _leave_as_is)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(init, n, fn)


def _leave_as_is(tensor, *args, **kwargs):
    return tensor


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, quantization: str = "none",
               group_size: int = 32, shard: Shard = Shard(), comm: Comm | None = None) -> CausalLM:
    """Build our model from a model folder or a .gguf file, weights in ``dtype`` on ``device``.

    ``quantization``: ``auto`` (the checkpoint's own), ``none`` (dense), ``int8``, ``int4`` (group
    ``group_size``), ``awq`` or ``fp8`` (GPU); the method chosen is ``model.quantization``. With a ``shard`` of
    more than one rank, only this rank's slices (``sharded_load.py``). A quantized model on the CPU
    comes from the prepared-model cache when it is there, and goes into it when it is not."""
    path = Path(path)
    with startup.phase("weights"), no_random_init():
        if shard.size > 1:
            from folio.core.executor.model.sharded_load import load_sharded

            return load_sharded(path, dtype, device, quantization, shard, comm)
        entry = prepared_entry(path, dtype, device, quantization, group_size)
        model = load_prepared(entry) if entry is not None else None
        if model is None:
            t0 = time.perf_counter()
            model = _load_model(path, dtype, device, quantization, group_size)
            if (entry is not None and model.quantization in ("int4", "int8", "gguf")
                    and time.perf_counter() - t0 >= PREPARED_MIN_BUILD_S):
                save_prepared(model, entry)
        return model


def _load_model(path: Path, dtype: torch.dtype, device: torch.device, quantization: str,
                group_size: int) -> CausalLM:
    if path.is_dir():
        model_spec(load_hf_config(path))  # an unsupported model fails before its weights are read
    source = path if path.suffix == ".gguf" else prepared_source(path) if path.is_dir() else None
    if source is not None and device.type == "cpu" and dtype == torch.float32:
        model = load_gguf_native(source, load_hf_config(path) if path.is_dir() else None, quantization)
        if model is not None:
            return model
    config, state, checkpoint_method, quant = read_checkpoint(path)
    method = resolve_quantization(quantization, checkpoint_method, device)
    spec = model_spec(config)  # raises for a model no family runs
    check_runtime(spec, device=device.type, quantization=method)
    with torch.device("meta"):
        model = build_model(spec, config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    layout = type(model).checkpoint_layout(spec)
    fused = remap_state_dict(state, layout | model.extra_layout(), shapes)
    model.load_state_dict(fused, strict=True, assign=True)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.init_rope(dtype, device)
    if hasattr(model, "read_pooling"):  # an encoder-only model pools as its sentence-transformers files say
        model.read_pooling(path)
    model.quantization = method
    if method == "fp8":
        quantize_model_gpu(model, method)
    elif method != "none" and device.type == "cuda":
        quantize_model_gpu(model, method, _fused_quant_weights(state, quant, spec, method, group_size, True, layout))
    elif method != "none":
        weights = _fused_quant_weights(state, quant, spec, method, group_size, layout=layout)
        quantize_model(model, weights, method, group_size)
    return model


# --------------------------------------------------------------------------- the prepared-model cache
PREPARED_KEEP = 8  # entries kept (the newest by use); each is about the quantized model's size
PREPARED_MIN_BUILD_S = 1.0  # a model built faster than this is not worth a cache entry (the tests' tiny ones)


@cache
def _code_digest() -> str:
    """The loading code's source (model families, quantization and packing): a new folio makes new entries."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    for pattern in ("model/*.py", "quant/*.py", "kernels/csrc/*.[ch]"):  # the tiles' layout is quant.c's
        for f in sorted(root.glob(pattern)):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _input_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))
    source = prepared_source(path)
    return files + ([source] if source is not None else [])


def prepared_entry(path: Path, dtype: torch.dtype, device: torch.device, quantization: str,
                   group_size: int) -> Path | None:
    """Where a quantized CPU model built from ``path`` is cached; None when it is not cached (another
    device, ``FOLIO_MODEL_CACHE=0``, or a path that is neither a file nor a folder)."""
    if device.type != "cpu" or quantization == "none" or os.environ.get("FOLIO_MODEL_CACHE", "1") in ("0", "false", "no"):
        return None
    if not path.exists():
        return None
    h = hashlib.sha256(f"{_code_digest()} {dtype} {quantization} {group_size}".encode())
    for f in _input_files(path):
        st = f.stat()
        h.update(f"{f.resolve()} {st.st_size} {st.st_mtime_ns}".encode())
    return cache_dir() / "prepared" / f"{h.hexdigest()[:24]}.pt"


def load_prepared(entry: Path) -> CausalLM | None:
    """The cached model, its tensors mapped from the file (copy on write); None when absent or unreadable."""
    if not entry.exists():
        startup.note("weights_cache", "miss")
        return None
    try:
        model = torch.load(entry, mmap=True, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: build the model again and replace it
        log.warning("prepared model unreadable; rebuilding it", path=str(entry), error=str(exc))
        startup.note("weights_cache", "unreadable")
        return None
    if not isinstance(model, CausalLM):
        startup.note("weights_cache", "unreadable")
        return None
    os.utime(entry)  # its place among the newest
    startup.note("weights_cache", "hit")
    return model


class LazyHFConfig:
    """A cached model's transformers config, kept as its class's name and ``to_dict()`` and rebuilt on
    first use: unpickling the config itself imports its transformers module, a second of start-up
    that serving never needs (the model reads its config only while it is built)."""

    def __init__(self, config):
        self._cls = (type(config).__module__, type(config).__qualname__)
        self._dict = config.to_dict()
        self._config = None

    def __getstate__(self) -> dict:
        return {"_cls": self._cls, "_dict": self._dict, "_config": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_cls", "_dict", "_config"):
            raise AttributeError(name)
        if self._config is None:
            import importlib

            cls = getattr(importlib.import_module(self._cls[0]), self._cls[1])
            self._config = cls.from_dict(self._dict)
        return getattr(self._config, name)


def save_prepared(model: CausalLM, entry: Path) -> None:
    """Write the built model to ``entry`` (atomically) and drop the oldest entries past ``PREPARED_KEEP``;
    a failure (a full disk) is logged and costs only the next start's time."""
    tmp, hf_config = None, getattr(model, "hf_config", None)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=entry.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            if hf_config is not None and hasattr(hf_config, "to_dict"):
                model.hf_config = LazyHFConfig(hf_config)
            try:
                torch.save(model, f)
            finally:
                model.hf_config = hf_config
        os.replace(tmp, entry)
        entries = sorted(entry.parent.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[PREPARED_KEEP:]:
            old.unlink(missing_ok=True)
    except Exception as exc:
        log.warning("could not cache the prepared model", path=str(entry), error=str(exc))
        if tmp is not None:
            tmp.unlink(missing_ok=True)

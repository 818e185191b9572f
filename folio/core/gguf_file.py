"""A GGUF file's metadata and tensors, read fast, and the ``transformers`` config its metadata describes.

``GGUFFile``: the header parsed with ``struct``, arrays of strings (the tokenizer's vocabulary)
skipped unless asked for, every tensor a view of one memory map. gguf-py's ``GGUFReader`` builds a
numpy array per vocabulary string: 20 s for SmolLM2's 49k tokens on a loaded 2-core machine, more
for Llama 3's 128k. ``read_gguf_config`` / ``gguf_config``: the config of the architectures folio
runs, rebuilt from the metadata as llama.cpp leaves it (docs/modules.md). Torch-free: the tokenizer
service reads its model's config here too.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
_ITEM = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's dims, innermost first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """``fields``: key -> value (str, int, float, bool, list); string arrays are None unless their
    key starts with one of ``read_strings``. ``tensors``: in the file's order."""

    def __init__(self, path: str | Path, read_strings: tuple[str, ...] = ()):
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self.mmap
        if buf[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} (2 and 3 are read)")
        self._at = 24
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            (vtype,) = struct.unpack_from("<I", buf, self._at)
            self._at += 4
            self.fields[key] = self._value(vtype, key.startswith(read_strings) if read_strings else False)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = struct.unpack_from("<I", buf, self._at)
            dims = np.frombuffer(buf, dtype=np.uint64, count=n_dims, offset=self._at + 4).astype(np.int64)
            ggml_type, offset = struct.unpack_from("<IQ", buf, self._at + 4 + 8 * n_dims)
            self._at += 4 + 8 * n_dims + 12
            infos.append((name, dims, ggml_type, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = (self._at + align - 1) // align * align
        self.data = np.frombuffer(buf, dtype=np.uint8)
        self.tensors = [self._tensor(gguf, start, *info) for info in infos]

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.mmap, self._at)
        s = self.mmap[self._at + 8:self._at + 8 + n].decode("utf-8", errors="replace")
        self._at += 8 + n
        return s

    def _value(self, vtype: int, keep_strings: bool):
        buf = self.mmap
        if vtype == STRING:
            return self._string()
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            (v,) = struct.unpack_from(fmt, buf, self._at)
            self._at += struct.calcsize(fmt)
            return v
        if vtype != ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        item, n = struct.unpack_from("<IQ", buf, self._at)
        self._at += 12
        if item in _NUMPY:
            values = np.frombuffer(buf, dtype=_NUMPY[item], count=n, offset=self._at)
            self._at += values.nbytes
            return values.tolist()
        if item == STRING:
            if keep_strings:
                return [self._string() for _ in range(n)]
            for _ in range(n):  # skipped: only their lengths are read
                (length,) = struct.unpack_from("<Q", buf, self._at)
                self._at += 8 + length
            return None
        return [self._value(item, keep_strings) for _ in range(n)]  # arrays of arrays

    def _tensor(self, gguf, start: int, name: str, dims: np.ndarray, ggml_type: int, offset: int) -> GGUFTensor:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(dims))
        n_bytes = n_elements * type_size // block
        np_dims = tuple(reversed(dims.tolist()))
        at = start + offset
        if qtype.name in _ITEM:
            item = np.dtype(_ITEM[qtype.name])
            data = self.data[at:at + n_bytes].view(item).reshape(np_dims)
        else:
            data = self.data[at:at + n_bytes].reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
        return GGUFTensor(name, qtype, dims, n_elements, n_bytes, at, data)

    def release(self, tensor: GGUFTensor) -> None:
        """Let the kernel drop the tensor's pages from this process (they stay in the page cache):
        a tensor repacked once is not read again, and its mapped pages would count as resident."""
        page = mmap.PAGESIZE
        lo = tensor.data_offset // page * page
        hi = -(-(tensor.data_offset + tensor.n_bytes) // page) * page
        try:
            self.mmap.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(self.mmap)) - lo)
        except (AttributeError, OSError, ValueError):
            pass  # an old Python or another OS: the pages stay mapped until the file is closed


# ---------------------------------------------------------------------------- the config
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3")


def metadata(reader) -> dict:
    """The metadata key -> value, without the tokenizer's vocabulary arrays (only its ids)."""
    out = {}
    for key, value in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and not key.endswith("_token_id"):
            continue
        if key.startswith("GGUF."):
            continue
        out[key] = value
    return out


def read_gguf_config(path):
    """The checkpoint's ``transformers`` config, rebuilt from a GGUF file's metadata."""
    reader = GGUFFile(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture", "")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; folio reads {', '.join(ARCHITECTURES)}")
    return gguf_config(meta, {t.name: t for t in reader.tensors})


def _rope(meta: dict, arch: str, default_theta: float = 10000.0) -> dict:
    """``rope_parameters`` from ``{arch}.rope.*`` (linear and YaRN scaling; LongRoPE is Phi-3's)."""
    params = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", default_theta))}
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        params.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn" and factor:
        params.update(rope_type="yarn", factor=float(factor),
                      original_max_position_embeddings=int(meta[f"{arch}.rope.scaling.original_context_length"]))
        for key, hf in (("yarn_ext_factor", "extrapolation_factor"), ("yarn_attn_factor", "attention_factor"),
                        ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in meta:
                params[hf] = float(meta[f"{arch}.rope.scaling.{key}"])
    elif kind not in ("none", "linear", "yarn", "longrope"):
        raise ValueError(f"unsupported GGUF RoPE scaling {kind!r}")
    return params


def _llama3_rope(params: dict, factors: np.ndarray, head_dim: int) -> dict:
    """Llama 3.1+'s RoPE scaling, which llama.cpp writes as ``rope_freqs`` (one divisor per
    frequency) and not as parameters: the llama3 parameters that give exactly those divisors.
    ``factor`` is the largest divisor; the original context (a power of two) and the low/high
    frequency factors are searched; a file that no such parameters explain is refused."""
    factors = factors.astype(np.float64)
    if np.all(factors == 1.0):
        return params
    inv_freq = 1.0 / (params["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv_freq
    factor = float(factors.max())
    for old in (2**k for k in range(4, 22)):
        for low in (0.5, 1.0, 2.0, 4.0):
            for high in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0):
                if high <= low:
                    continue
                smooth = (old / wavelen - low) / (high - low)
                want = np.where(wavelen < old / high, 1.0, np.where(
                    wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
                if np.allclose(want, factors, rtol=1e-5, atol=0):
                    return {**params, "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": old}
    raise ValueError("the GGUF's rope_freqs are not Llama 3's RoPE scaling for any parameters tried; not supported")


def _one(value, what: str) -> int:
    """A per-layer metadata value that llama.cpp may write as an array: the same for every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {what} differs between layers ({sorted(set(value))}); not supported")
        return int(value[0])
    return int(value)


class _Meta:
    """A GGUF's metadata and tensors, with the values every family reads."""

    def __init__(self, meta: dict, tensors: dict):
        if "token_embd.weight" not in tensors:
            raise ValueError("the GGUF file has no token_embd.weight")
        self.meta, self.tensors, self.arch = meta, tensors, meta["general.architecture"]
        self.hidden = int(self.get("embedding_length"))
        self.heads = _one(self.get("attention.head_count"), "attention.head_count")
        self.layers = int(self.get("block_count"))
        self.head_dim = int(self.get("attention.key_length", 0)) or (
            int(self.get("rope.dimension_count", 0)) if self.arch == "llama" else 0) or self.hidden // self.heads
        self.num_experts = int(self.get("expert_count", 0) or 0)

    def get(self, key, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def common(self) -> dict:
        """What every family's config takes."""
        c = dict(
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),  # the embedding's rows (dims reversed)
            hidden_size=self.hidden,
            intermediate_size=int(self.get("feed_forward_length", 0) or 0),
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=_one(self.get("attention.head_count_kv", self.heads), "attention.head_count_kv"),
            max_position_embeddings=int(self.get("context_length", 2048)),
            rms_norm_eps=float(self.get("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings="output.weight" not in self.tensors,
        )
        for key, hf in (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk")):
            if f"tokenizer.ggml.{key}_token_id" in self.meta:
                c[f"{hf}_token_id"] = int(self.meta[f"tokenizer.ggml.{key}_token_id"])
        if not c["intermediate_size"]:  # not written: the first layer's gate rows
            gate = self.tensors.get("blk.0.ffn_gate.weight") or self.tensors.get("blk.0.ffn_gate_exps.weight")
            c["intermediate_size"] = int(gate.shape[1]) if gate is not None else 0
        return c


def _llama(m: _Meta) -> tuple[str, str, dict]:
    rope = _rope(m.meta, m.arch)
    if m.has("rope_freqs.weight"):
        rope = _llama3_rope(rope, np.asarray(m.tensors["rope_freqs.weight"].data), m.head_dim)
    if m.num_experts:
        return "mixtral", "MixtralForCausalLM", dict(
            head_dim=m.head_dim, num_local_experts=m.num_experts, num_experts_per_tok=int(m.get("expert_used_count")),
            rope_parameters=rope, sliding_window=None)
    return "llama", "LlamaForCausalLM", dict(head_dim=m.head_dim, rope_parameters=rope,
                                             attention_bias=m.has("blk.0.attn_q.bias"))


def _qwen(m: _Meta) -> tuple[str, str, dict]:
    if m.arch == "qwen2":
        return "qwen2", "Qwen2ForCausalLM", dict(rope_parameters=_rope(m.meta, m.arch), use_sliding_window=False)
    return "qwen3", "Qwen3ForCausalLM", dict(head_dim=m.head_dim, rope_parameters=_rope(m.meta, m.arch),
                                             use_sliding_window=False, attention_bias=m.has("blk.0.attn_q.bias"))


def _qwen_moe(m: _Meta) -> tuple[str, str, dict]:
    qwen3 = m.arch == "qwen3moe"
    sparse = [m.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(m.layers)]
    # llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's
    extra = dict(rope_parameters=_rope(m.meta, m.arch), use_sliding_window=False, num_experts=m.num_experts,
                 num_experts_per_tok=int(m.get("expert_used_count")), norm_topk_prob=bool(m.get("expert_weights_norm", qwen3)),
                 moe_intermediate_size=int(m.get("expert_feed_forward_length")), decoder_sparse_step=1,
                 mlp_only_layers=[i for i, s in enumerate(sparse) if not s])
    if qwen3:
        extra.update(head_dim=m.head_dim, attention_bias=m.has("blk.0.attn_q.bias"))
        return "qwen3_moe", "Qwen3MoeForCausalLM", extra
    extra.update(shared_expert_intermediate_size=int(m.get("expert_shared_feed_forward_length", 0) or 0))
    return "qwen2_moe", "Qwen2MoeForCausalLM", extra


def _gemma(m: _Meta) -> tuple[str, str, dict]:
    # llama.cpp scales queries by head_dim ** -0.5, or (hidden / heads) ** -0.5 for the 27B models
    big = (m.arch == "gemma2" and m.layers == 46) or (m.arch == "gemma3" and m.layers == 62)
    scalar = float(m.get("attention.scale", 0.0) or 0.0) ** -2 if m.get("attention.scale") else \
        (m.hidden // m.heads if big else m.head_dim)
    extra = dict(head_dim=m.head_dim, query_pre_attn_scalar=scalar, hidden_activation="gelu_pytorch_tanh",
                 sliding_window=int(m.get("attention.sliding_window", 4096)),
                 final_logit_softcapping=m.get("final_logit_softcapping"))
    pattern = m.get("attention.sliding_window_pattern")
    if m.arch == "gemma2":
        model_type, arch_name = "gemma2", "Gemma2ForCausalLM"
        extra.update(rope_parameters=_rope(m.meta, m.arch), attn_logit_softcapping=m.get("attn_logit_softcapping"))
    else:
        model_type, arch_name = "gemma3_text", "Gemma3ForCausalLM"
        full = _rope(m.meta, m.arch, default_theta=1_000_000.0)
        local = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base_swa", 10000.0))}
        extra.update(rope_parameters={"full_attention": full, "sliding_attention": local}, attn_logit_softcapping=None)
        if "attention.sliding_window" not in {k[len(m.arch) + 1:] for k in m.meta}:
            pattern = [False] * m.layers  # no window written: every layer global
    if isinstance(pattern, list):  # per layer: True for a windowed one
        extra["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    elif pattern:
        extra["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                                for i in range(m.layers)]
    return model_type, arch_name, extra


def _phi3(m: _Meta) -> tuple[str, str, dict]:
    rope = _rope(m.meta, m.arch)
    rope_dims = int(m.get("rope.dimension_count", m.head_dim))
    if rope_dims != m.head_dim:
        rope["partial_rotary_factor"] = rope_dims / m.head_dim
    original = int(m.get("rope.scaling.original_context_length", int(m.get("context_length", 2048))))
    if m.has("rope_factors_long.weight"):
        factors = {k: np.asarray(m.tensors[f"rope_factors_{k}.weight"].data, dtype=np.float32).tolist()
                   for k in ("long", "short")}
        rope.update(rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"])
    window = int(m.get("attention.sliding_window", 0) or 0)
    return "phi3", "Phi3ForCausalLM", dict(rope_parameters=rope, original_max_position_embeddings=original,
                                           sliding_window=window or None, hidden_act="silu")


_FAMILIES = {"llama": _llama, "qwen2": _qwen, "qwen3": _qwen, "qwen2moe": _qwen_moe, "qwen3moe": _qwen_moe,
             "gemma2": _gemma, "gemma3": _gemma, "phi3": _phi3}


def gguf_config(meta: dict, tensors: dict):
    """The HF config of a GGUF checkpoint from its metadata ``meta`` and its tensors (name -> tensor,
    for the vocabulary, the tied head, biases, MoE layers and LongRoPE factors)."""
    from transformers import AutoConfig

    m = _Meta(meta, tensors)
    if m.arch not in _FAMILIES:
        raise ValueError(f"GGUF architecture {m.arch!r} is not supported; folio reads {', '.join(ARCHITECTURES)}")
    model_type, arch_name, extra = _FAMILIES[m.arch](m)
    config = AutoConfig.for_model(model_type, **m.common(), **extra)
    config.architectures = [arch_name]
    return config


_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}


def model_type(path) -> str:
    """The ``transformers`` model type of a GGUF (what ``gguf_config`` builds), from its metadata alone."""
    reader = GGUFFile(path)
    arch = reader.fields.get("general.architecture", "")
    if arch not in _MODEL_TYPES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; folio reads {', '.join(ARCHITECTURES)}")
    if arch == "llama" and reader.fields.get("llama.expert_count"):
        return "mixtral"
    return _MODEL_TYPES[arch]


def model_config_dict(path) -> dict:
    """What the tokenizer service reads of a GGUF's config (context length, vocabulary, EOS), without
    building the config: no transformers config class is imported."""
    reader = GGUFFile(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture", "")
    out = {"max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048))}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is not None:
        out["vocab_size"] = int(embed.shape[1])
    if "tokenizer.ggml.eos_token_id" in meta:
        out["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
    return out


def hf_tokenizer(path):
    """The tokenizer AutoTokenizer makes of a GGUF, without its reading the file's config through
    gguf-py (10 s and more for a vocabulary of 128k): the class of the file's model type, told."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    path = Path(path)
    kind = model_type(path)
    if kind in TOKENIZER_MAPPING_NAMES:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, tokenizer_type=kind)
    return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)  # AutoTokenizer's for it

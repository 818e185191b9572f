"""GGUF checkpoints as llama.cpp writes them, read back as Hugging Face ones: the config rebuilt from
the file's metadata (``gguf_config``), the tensors under their HF names (``GGUFSlices``), and the
linears the file holds in 4-bit blocks (``gguf_int4_weights``).

Architectures (``general.architecture``): ``llama`` (Llama, Mistral, SmolLM2; with
``expert_count`` > 0 it is Mixtral), ``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe``, ``gemma2``,
``gemma3`` (text) and ``phi3``. Names follow llama.cpp's converter (``convert_hf_to_gguf.py`` and
gguf-py's ``tensor_mapping``): ``blk.{i}.attn_q`` is ``model.layers.{i}.self_attn.q_proj``, and so on.
What the converter changed is undone on the way back:

- llama (and Mixtral) q/k rows (weights and biases) are interleaved per head for llama.cpp's RoPE;
  they are un-permuted (the permutation stays within a head, so a slice of whole heads is
  un-permuted on its own). No other architecture is permuted;
- Mixtral's and the Qwen MoEs' experts are stacked into 3-D tensors (``ffn_gate_exps``,
  ``ffn_up_exps``, ``ffn_down_exps``, ``[experts, out, in]``); each expert reads back as its own
  HF tensor (``block_sparse_moe.experts.{e}.w1`` / ``mlp.experts.{e}.gate_proj``), one 2-D slab of
  the stack. The router is ``ffn_gate_inp``; Qwen2-MoE's shared expert is ``ffn_*_shexp``;
- Phi-3 keeps ``attn_qkv`` and ``ffn_up`` (gate then up) fused, as its HF checkpoint does;
- Gemma stores every norm weight (q/k norms and the final norm included) with the ``+1`` of its
  ``(1 + w)`` RMSNorm already added: 1 is subtracted again (as transformers' GGUF loader does), so
  the checkpoint's own ``w`` reaches ``layers.RMSNorm``, which folds the ``+1`` in at load (exact
  in fp32 for every stored value from 0.5 up); Gemma 2/3's ``ffn_norm`` is
  ``pre_feedforward_layernorm``, ``post_attention_norm`` and ``post_ffw_norm`` the post-norms.

The config is built from the metadata with the family's ``transformers`` config class:
``{arch}.block_count``, ``.embedding_length``, ``.feed_forward_length``, ``.attention.head_count(_kv)``,
``.attention.key_length`` (head_dim), ``.rope.freq_base`` (``_swa`` for Gemma 3's local layers),
``.rope.scaling.*``, ``.attention.sliding_window``, ``.attn_logit_softcapping``,
``.final_logit_softcapping``, ``.expert_count``, ``.expert_used_count``,
``.expert_feed_forward_length``; the vocabulary is the embedding's rows, and the LM head is tied
when the file has no ``output.weight``. What llama.cpp leaves implicit is filled in as llama.cpp
does: Gemma's query scale (head_dim, or hidden/heads for the 27B models), Gemma 3's 5:1 local
layers and 10k local RoPE base, Qwen3-MoE's renormalised top-k, Phi-3's LongRoPE factors (the
``rope_factors_long``/``short`` tensors), Llama 3's RoPE scaling (the parameters that reproduce
its ``rope_freqs`` tensor exactly; other divisors are refused).

``GGUFSlices.read`` takes a slice of whole rows or of whole quantized blocks from the
memory-mapped file and dequantizes only that (``gguf_file.GGUFFile`` maps the file; a quantized
tensor is a ``[rows, row bytes]`` array of blocks along the input dimension, 32 values per block
for Q4_0/Q4_1/Q8_0, 256 for the K-quants), so a tensor-parallel rank (``sharded_load.py``) never
holds the whole dense model; the unsharded loader (``loader.read_checkpoint``) reads every tensor
whole through the same code. Q4_0 (``d (q - 8)``) and Q4_1 (``d q + m``) linears also come back as
``Int4Weight`` groups of 32 (``scale = d``, ``zero = 0`` or ``m + 8 d``), which the int4 path serves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from folio.core.executor.model.gguf_file import GGUFFile
from folio.core.executor.quant.formats import Int4Weight

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3")

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# per-layer tensors, every architecture (blk.{i}.<key> -> model.layers.{i}.<value>)
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GEMMA = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER = {"gemma2": _GEMMA, "gemma3": _GEMMA, "phi3": {"ffn_up": "mlp.gate_up_proj"}}
# the MoE block: (HF block name, router, expert names for ffn_gate_exps, ffn_up_exps, ffn_down_exps)
_MIXTRAL_MOE = ("block_sparse_moe", "gate", ("w1", "w3", "w2"))
_QWEN_MOE = ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_INT4_TYPES = ("Q4_0", "Q4_1")


def _meta(reader) -> dict:
    """The metadata key -> value, without the tokenizer's vocabulary arrays (only its ids)."""
    out = {}
    for key, value in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and not key.endswith("_token_id"):
            continue
        if key.startswith("GGUF."):
            continue
        out[key] = value
    return out


class GGUFSlices:
    """Reads slices of HF-named tensors from a GGUF file, dequantizing only what is asked for.

    ``config``: the checkpoint's config, rebuilt from the metadata when not given."""

    def __init__(self, path: Path, config=None):
        self.reader = GGUFFile(path)
        meta = _meta(self.reader)
        self.arch = meta.get("general.architecture", "")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} is not supported; folio reads "
                             f"{', '.join(ARCHITECTURES)}")
        by_name = {t.name: t for t in self.reader.tensors}
        self.config = config if config is not None else gguf_config(meta, by_name)
        # HF name -> (GGUF tensor, expert index or None)
        self.tensors: dict[str, tuple[object, int | None]] = {}
        for t in self.reader.tensors:
            for name, expert in self._hf_names(t):
                self.tensors[name] = (t, expert)
        self.permuted_heads = {}  # llama q/k: HF name -> heads in the whole tensor
        if self.arch == "llama":
            heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
            for name in self.tensors:
                if ".self_attn.q_proj." in name:
                    self.permuted_heads[name] = heads
                elif ".self_attn.k_proj." in name:
                    self.permuted_heads[name] = kv_heads
        self.norm_offset = 1.0 if self.arch in ("gemma2", "gemma3") else 0.0  # stored as 1 + w

    def _hf_names(self, t) -> list[tuple[str, int | None]]:
        """llama.cpp's tensor name -> the HF names it holds (an expert stack holds one per expert);
        none for what we do not load (rope_freqs, rope_factors_*)."""
        parts = t.name.split(".")
        if len(parts) == 2 and parts[0] in _TOP:
            return [(f"{_TOP[parts[0]]}.{parts[1]}", None)]
        if len(parts) != 4 or parts[0] != "blk":
            return []
        i, key, suffix = parts[1], parts[2], parts[3]
        block, router, expert_names = _MIXTRAL_MOE if self.arch == "llama" else _QWEN_MOE
        if key == "ffn_gate_inp":
            return [(f"model.layers.{i}.{block}.{router}.{suffix}", None)]
        if key in _EXPERTS:
            name = expert_names[_EXPERTS.index(key)]
            num_experts = int(t.shape[-1])  # GGUF dims are reversed: [in, out, experts]
            return [(f"model.layers.{i}.{block}.experts.{e}.{name}.{suffix}", e) for e in range(num_experts)]
        kind = _ARCH_LAYER.get(self.arch, {}).get(key) or _LAYER.get(key)
        return [(f"model.layers.{i}.{kind}.{suffix}", None)] if kind else []

    def read(self, name: str, dim: int | None, start: int, end: int) -> torch.Tensor:
        """``name`` whole (``dim`` None), or its rows (0) or columns (1) ``start:end``, fp32."""
        import gguf

        if name not in self.tensors:
            raise KeyError(f"checkpoint lacks {name}")
        t, expert = self.tensors[name]
        data = t.data if expert is None else t.data[expert]  # rows x row bytes (quantized) or rows x values
        qtype = t.tensor_type
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        quantized = data.dtype == np.uint8
        if dim == 0:
            data = data[start:end]
        elif dim == 1:
            if quantized and (start % block or end % block):
                raise ValueError(f"{name}: columns {start}:{end} do not fall on its {qtype.name} blocks of "
                                 f"{block} values; choose a tensor-parallel size that splits whole blocks")
            data = data[:, start // block * type_size: end // block * type_size] if quantized else data[:, start:end]
        values = gguf.dequantize(np.ascontiguousarray(data), qtype)
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
        if self.norm_offset and name.endswith("norm.weight"):
            tensor = tensor - self.norm_offset
        order = self.row_order(name, tensor.shape[0])
        return tensor if order is None else tensor[order]

    def row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """transformers' ``reverse_permute_weights`` for llama q/k, per head of the rows read:
        HF row (head, half, i) is GGUF row (head, i, half)."""
        if name not in self.permuted_heads:
            return None
        t, _ = self.tensors[name]
        head_dim = int(t.shape[-1] if len(t.shape) == 1 else t.shape[1]) // self.permuted_heads[name]
        heads = rows // head_dim  # a row slice (dim 0) is whole heads; a column slice keeps every row
        return torch.arange(rows).reshape(heads, head_dim // 2, 2).transpose(1, 2).reshape(rows)

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor whole, HF-named (the unsharded loader's state dict)."""
        return {name: self.read(name, None, 0, 0) for name in self.tensors}

    def native_type(self, name: str, k_unit: dict[str, int]) -> str | None:
        """The GGML type of ``name`` when it is a 2-D tensor (not an expert's slab) stored in a type
        of ``k_unit`` (type -> inputs per unit) whose rows are whole units; else None."""
        if name not in self.tensors:
            return None
        t, expert = self.tensors[name]
        kind = t.tensor_type.name
        if expert is not None or len(t.shape) != 2 or kind not in k_unit or int(t.shape[0]) % k_unit[kind]:
            return None
        return kind

    def raw_rows(self, name: str, start: int, end: int | None) -> tuple[np.ndarray, np.ndarray | None, int]:
        """Rows ``start:end`` (end None: all) of a quantized 2-D tensor as the file's blocks
        ([rows, bytes a row], memory-mapped), the order that un-permutes them (llama q/k) or None,
        and the number of inputs a row holds."""
        t, _ = self.tensors[name]
        data = t.data if end is None else t.data[start:end]
        return data, self.row_order(name, data.shape[0]), int(t.shape[0])

    def linear_types(self) -> set[str]:
        """The GGML types of the decoder's projections (attention, MLP, experts)."""
        return {t.tensor_type.name for name, (t, _) in self.tensors.items()
                if name.endswith("_proj.weight") or name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))}

    def int4_weights(self) -> dict[str, Int4Weight]:
        """The 2-D projections stored as Q4_0 or Q4_1, as ``Int4Weight`` groups of 32 (HF names,
        q/k rows un-permuted). Experts are not included (the MoE block rounds its own)."""
        out = {}
        for name, (t, expert) in self.tensors.items():
            if expert is not None or not name.endswith("_proj.weight") or t.tensor_type.name not in _INT4_TYPES:
                continue
            q, d, m = _q4_rows(np.asarray(t.data), t.tensor_type.name)
            order = self.row_order(name, q.shape[0])
            if order is not None:
                q, d, m = q[order], d[order], m[order]
            out[name] = Int4Weight(q, d, m + 8.0 * d, 32)
        return out


def _q4_rows(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 (``d``, 16 bytes) or Q4_1 (``d``, ``m``, 16 bytes) rows ``[N, K/32 * bytes]`` ->
    (q [N, K] uint8, d [N, K/32], m [N, K/32]) with ``w = d q + m`` (Q4_0: ``m = -8 d``)."""
    n = raw.shape[0]
    head = 2 if kind == "Q4_0" else 4
    blocks = raw.reshape(n, -1, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8.0 * d
    qs = blocks[..., head:]  # byte j: element j in its low nibble, element j + 16 in its high one
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    return torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m))


def read_gguf(path: Path) -> tuple[object, dict[str, torch.Tensor], str, dict[str, Int4Weight]]:
    """(config, dense HF-named state, the file's own quantization, its int4 linears) for
    ``loader.read_checkpoint``.

    The quantization is ``int4`` when every projection is Q4_0/Q4_1 (served losslessly), ``int8``
    when every one is Q8_0 (served by per-channel requantization), else ``none`` (dense)."""
    reader = GGUFSlices(path)
    state = reader.read_all()
    kinds = reader.linear_types()
    if kinds and kinds <= set(_INT4_TYPES):
        method, quant = "int4", reader.int4_weights()
    elif kinds == {"Q8_0"}:
        method, quant = "int8", {}
    else:
        method, quant = "none", {}
    return reader.config, state, method, quant


def read_gguf_config(path: Path):
    """The checkpoint's ``transformers`` config, rebuilt from a GGUF file's metadata."""
    reader = GGUFFile(path)
    meta = _meta(reader)
    arch = meta.get("general.architecture", "")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; folio reads {', '.join(ARCHITECTURES)}")
    return gguf_config(meta, {t.name: t for t in reader.tensors})


# ---------------------------------------------------------------------------- the config
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


def gguf_config(meta: dict, tensors: dict):
    """The HF config of a GGUF checkpoint from its metadata ``meta`` and its tensors (name ->
    ``ReaderTensor``, for the vocabulary, the tied head, biases, MoE layers and LongRoPE factors)."""
    from transformers import AutoConfig

    arch = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    if "token_embd.weight" not in tensors:
        raise ValueError("the GGUF file has no token_embd.weight")
    hidden = int(get("embedding_length"))
    heads = _one(get("attention.head_count"), "attention.head_count")
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", 0)) or (int(get("rope.dimension_count", 0)) if arch == "llama" else 0) \
        or hidden // heads
    common = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # the embedding's rows (GGUF dims are reversed)
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0) or 0),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_one(get("attention.head_count_kv", heads), "attention.head_count_kv"),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensors,
    )
    for key, hf in (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk")):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            common[f"{hf}_token_id"] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    if not common["intermediate_size"]:  # not written: the first layer's gate rows
        gate = tensors.get("blk.0.ffn_gate.weight") or tensors.get("blk.0.ffn_gate_exps.weight")
        common["intermediate_size"] = int(gate.shape[1]) if gate is not None else 0
    num_experts = int(get("expert_count", 0) or 0)
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)]

    if arch == "llama":
        rope = _rope(meta, arch)
        if "rope_freqs.weight" in tensors:
            rope = _llama3_rope(rope, np.asarray(tensors["rope_freqs.weight"].data), head_dim)
    if arch == "llama" and num_experts:
        model_type, arch_name = "mixtral", "MixtralForCausalLM"
        extra = dict(head_dim=head_dim, num_local_experts=num_experts,
                     num_experts_per_tok=int(get("expert_used_count")), rope_parameters=rope, sliding_window=None)
    elif arch == "llama":
        model_type, arch_name = "llama", "LlamaForCausalLM"
        extra = dict(head_dim=head_dim, rope_parameters=rope, attention_bias="blk.0.attn_q.bias" in tensors)
    elif arch == "qwen2":
        model_type, arch_name = "qwen2", "Qwen2ForCausalLM"
        extra = dict(rope_parameters=_rope(meta, arch), use_sliding_window=False)
    elif arch == "qwen3":
        model_type, arch_name = "qwen3", "Qwen3ForCausalLM"
        extra = dict(head_dim=head_dim, rope_parameters=_rope(meta, arch), use_sliding_window=False,
                     attention_bias="blk.0.attn_q.bias" in tensors)
    elif arch in ("qwen2moe", "qwen3moe"):
        qwen3 = arch == "qwen3moe"
        model_type, arch_name = ("qwen3_moe", "Qwen3MoeForCausalLM") if qwen3 else ("qwen2_moe", "Qwen2MoeForCausalLM")
        # llama.cpp renormalises Qwen3-MoE's top-k weights and not Qwen2-MoE's
        norm = bool(get("expert_weights_norm", qwen3))
        extra = dict(rope_parameters=_rope(meta, arch), use_sliding_window=False, num_experts=num_experts,
                     num_experts_per_tok=int(get("expert_used_count")), norm_topk_prob=norm,
                     moe_intermediate_size=int(get("expert_feed_forward_length")), decoder_sparse_step=1,
                     mlp_only_layers=[i for i, s in enumerate(sparse) if not s])
        if qwen3:
            extra.update(head_dim=head_dim, attention_bias="blk.0.attn_q.bias" in tensors)
        else:
            shared = int(get("expert_shared_feed_forward_length", 0) or 0)
            extra.update(shared_expert_intermediate_size=shared)
    elif arch in ("gemma2", "gemma3"):
        # llama.cpp scales queries by head_dim ** -0.5, or (hidden / heads) ** -0.5 for the 27B models
        big = (arch == "gemma2" and layers == 46) or (arch == "gemma3" and layers == 62)
        scalar = float(get("attention.scale", 0.0) or 0.0) ** -2 if get("attention.scale") else \
            (hidden // heads if big else head_dim)
        extra = dict(head_dim=head_dim, query_pre_attn_scalar=scalar, hidden_activation="gelu_pytorch_tanh",
                     sliding_window=int(get("attention.sliding_window", 4096)),
                     final_logit_softcapping=get("final_logit_softcapping"))
        pattern = get("attention.sliding_window_pattern")
        if arch == "gemma2":
            model_type, arch_name = "gemma2", "Gemma2ForCausalLM"
            extra.update(rope_parameters=_rope(meta, arch), attn_logit_softcapping=get("attn_logit_softcapping"))
        else:
            model_type, arch_name = "gemma3_text", "Gemma3ForCausalLM"
            full = _rope(meta, arch, default_theta=1_000_000.0)
            local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
            extra.update(rope_parameters={"full_attention": full, "sliding_attention": local},
                         attn_logit_softcapping=None)
            if "attention.sliding_window" not in {k[len(arch) + 1:] for k in meta}:
                pattern = [False] * layers  # no window written: every layer global
        if isinstance(pattern, list):  # per layer: True for a windowed one
            extra["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        elif pattern:
            extra["layer_types"] = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                                    for i in range(layers)]
    elif arch == "phi3":
        model_type, arch_name = "phi3", "Phi3ForCausalLM"
        rope = _rope(meta, arch)
        rope_dims = int(get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            rope["partial_rotary_factor"] = rope_dims / head_dim
        original = int(get("rope.scaling.original_context_length", common["max_position_embeddings"]))
        if "rope_factors_long.weight" in tensors:
            factors = {k: np.asarray(tensors[f"rope_factors_{k}.weight"].data, dtype=np.float32).tolist()
                       for k in ("long", "short")}
            rope.update(rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"])
        window = int(get("attention.sliding_window", 0) or 0)
        extra = dict(rope_parameters=rope, original_max_position_embeddings=original, sliding_window=window or None,
                     hidden_act="silu")
    else:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; folio reads {', '.join(ARCHITECTURES)}")
    config = AutoConfig.for_model(model_type, **common, **extra)
    config.architectures = [arch_name]
    return config

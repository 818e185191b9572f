"""GGUF checkpoints as llama.cpp writes them, read back as Hugging Face ones: the config rebuilt from
the file's metadata (``folio.core.gguf_file.gguf_config``), the tensors under their HF names (``GGUFSlices``), and the
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

from folio.core.gguf_file import ARCHITECTURES, GGUFFile, gguf_config, metadata
from folio.core.executor.quant.formats import Int4Weight

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


class GGUFSlices:
    """Reads slices of HF-named tensors from a GGUF file, dequantizing only what is asked for.

    ``config``: the checkpoint's config, rebuilt from the metadata when not given."""

    def __init__(self, path: Path, config=None):
        self.reader = GGUFFile(path)
        meta = metadata(self.reader)
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

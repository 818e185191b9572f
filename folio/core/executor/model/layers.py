"""The shared layers every model family is built from: the spec, RMSNorm, the RoPE tables,
paged attention (with optional q/k norms), the dense SwiGLU/GeGLU MLP, the vocabulary embedding,
the oneDNN-packed linear, and ``CausalLM``, the decoder stack the family files subclass.

What the families differ in is a ``ModelSpec`` field, never a copy of a layer: per-layer sliding
windows (``layer_windows``, as transformers reads them from the config), attention and final logit
soft-caps, the query scale, Gemma's ``(1 + w)`` norms (``norm_offset``, folded in at load by
``RMSNorm``), its norms around attention and the MLP (``sandwich_norms``), its embedding scale
and GeGLU, and a second RoPE table for windowed layers (``CausalLM.local_rope``, Gemma 3).

The family files (``llama.py``, ``qwen3.py``, ``mixtral.py``, ...) pick from these; ``registry.py``
maps a checkpoint to its family; ``loader.py`` and ``sharded_load.py`` build the model
through it; ``runtime/runner.py`` packs its linears for the CPU (``pack_linears_for_cpu``).

The forward pass takes one flattened varlen batch (``input_ids``/``positions`` of every new token
of every scheduled sequence) and the per-layer K/V pools; attention goes through a backend
(``attention.TorchAttentionBackend``, the CPU or the CUDA kernels) that reads the pool through
block tables, with the layer's ``window`` and ``softcap``. The RoPE frequency table comes from
``transformers`` (every scaling type it knows, llama3 and longrope included), so ours is the same
as the reference implementation's.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up projections
are fused into one GEMM each (the family's ``checkpoint_layout`` says which checkpoint tensors
make each of ours). With tensor parallelism (``parallel.Shard``) each rank builds the same modules
at its shard's sizes: its query and KV heads, its part of the intermediate size and of the
vocabulary; ``comm`` sums the row-parallel outputs and gathers the logits.
"""

from __future__ import annotations

import ctypes

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS
from folio.core.executor.parallel.comm import Comm, Shard
from folio.core.executor.quant.linear import QuantLinear

# (checkpoint tensor name, dim to slice or None for the whole tensor, start, end); a parameter is
# its parts concatenated along rows, then reshaped to the parameter's shape
Part = tuple[str, int | None, int, int]


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder, read from a ``transformers`` config (the family fills in its extras)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    qk_norm: str = ""  # "head": RMSNorm over each head of q and k (Qwen3); "full": over all of q, k (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv (OLMoE)
    # mixture of experts (moe.py); num_experts 0 for a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (sigmoid-gated)
    moe_layers: tuple[bool, ...] = ()  # which layers have experts (the rest a dense MLP)
    # attention variants: per-layer sliding windows (Mistral, Qwen2/3, Phi-3, Gemma 2/3), soft-caps
    # and a query scale override (Gemma 2/3)
    layer_windows: tuple[int, ...] = ()  # each layer's window W (0: global); () for all global
    attn_softcap: float = 0.0  # scores s -> c tanh(s / c) before the mask (0: off)
    final_softcap: float = 0.0  # the same on the final logits
    query_pre_attn_scalar: float = 0.0  # the attention scale is its -1/2 power (0: head_dim's)
    # Gemma's layer
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w) (Gemma: 1; see RMSNorm)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2/3)
    embed_scale: float = 1.0  # the embeddings times this (Gemma: sqrt(hidden_size))

    @staticmethod
    def from_hf_config(config) -> "ModelSpec":
        """The fields every family shares; ``registry.model_spec`` is the checked entry point."""
        model_type = getattr(config, "model_type", "llama")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} (gated MLPs of {', '.join(ACTIVATIONS)} only)")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return ModelSpec(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            layer_windows=layer_windows(config),
            activation=ACTIVATIONS[act],
        )


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # the config's name -> the MLP's


def layer_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers applies it: by ``layer_types`` where the config
    has them (Gemma 2/3; Qwen2/3 derive them from ``use_sliding_window`` and ``max_window_layers``),
    else ``sliding_window`` on every layer (Mistral, Phi-3, Qwen3-MoE; None or 0: none)."""
    window = int(getattr(config, "sliding_window", None) or 0)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported attention layer types {sorted(unknown)} (sliding and full attention only)")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def rope_cos_sin(config, max_positions: int, dtype: torch.dtype,
                 layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` computed as transformers computes them.

    ``layer_type``: a config whose ``rope_parameters`` are per layer type (Gemma 3: its local
    base for ``sliding_attention``, the global one for ``full_attention``) gives that type's.
    LongRoPE (Phi-3's ``longrope``/``su``): transformers rotates a whole sequence by the short
    factors while it is within ``original_max_position_embeddings`` and recomputes all of it with
    the long factors once it is longer; a paged KV cache cannot re-rotate its keys, so here each
    position has one rotation: the short factors' below ``original_max_position_embeddings`` (the
    same as transformers for every sequence within it), the long factors' from there on (the same
    as transformers gives those positions)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_scaling = 1.0
    elif rope_type in ("linear", "llama3", "yarn", "longrope"):
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    else:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    inv_freq = inv_freq.float().expand(max_positions, -1)  # [max_positions, head_dim / 2]
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        long_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=original + 1, **kwargs)
        inv_freq = torch.cat([inv_freq[:original], long_freq.float().expand(max_positions, -1)[original:]])
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


@dataclass
class RopeTables:
    """A second pair of cos/sin tables (Gemma 3's local layers); ``layer_ops.rope_inputs`` reads
    ``rope_cos``/``rope_sin`` from it as from the model."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor


class RMSNorm(nn.Module):
    """``w * x / rms(x)``; with an ``offset`` (Gemma: 1) the checkpoint's ``w`` means ``offset + w``.

    The offset is folded into the weight once, as the checkpoint is loaded (``_load_from_state_dict``,
    the one place it happens: every ``load_state_dict``, both loaders' path, goes through it), so
    every backend's norm kernel stays the plain one. A loader must therefore hand over the
    checkpoint's own ``w``: llama.cpp's converter stores Gemma's norms with the +1 already added,
    so a GGUF reader subtracts 1 from them first (as transformers' GGUF loader does)."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if self.offset and key in state_dict:  # in fp32, as transformers computes (1 + w)
            state_dict[key] = state_dict[key].float() + self.offset
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


    def forward(self, x: torch.Tensor) -> torch.Tensor:  # normalises the last dim
        return TORCH_LAYER_OPS.rms_norm(x, self)


class Attention(nn.Module):
    """Paged attention over this rank's heads; ``window`` (this layer's sliding window, set by
    ``CausalLM`` from ``spec.layer_windows``) and ``softcap`` go to the backend's ``attend``."""

    def __init__(self, spec: ModelSpec, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__()
        h0, h1 = shard.split(spec.num_heads, "the number of attention heads")
        kv0, kv1 = shard.kv_heads(spec.num_heads, spec.num_kv_heads)
        self.num_heads = h1 - h0  # this rank's query heads
        self.num_kv_heads = kv1 - kv0
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * spec.head_dim
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.scale = (spec.query_pre_attn_scalar or spec.head_dim) ** -0.5
        self.window = 0  # 0: global; W: the last W positions, this one included
        self.softcap = spec.attn_softcap
        self.kv_scales = (1.0, 1.0)  # an fp8 pool's (k_scale, v_scale), set by kv_quant's calibration
        self.kv_rotation: torch.Tensor | None = None  # an fp8 pool's basis for q, k and v (kv_quant)
        self.comm = comm
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.qk_norm, self.clip_qkv = spec.qk_norm, spec.clip_qkv
        if spec.qk_norm:
            per_head = spec.qk_norm == "head"
            self.q_norm = RMSNorm(spec.head_dim if per_head else self.q_size, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim if per_head else self.kv_size, spec.rms_norm_eps, spec.norm_offset)

    def norm_qkv(self, qkv: torch.Tensor) -> torch.Tensor:  # [n, q_size + 2 kv_size], the same shape back
        """q/k norms and clipping, before RoPE: every backend's fused RoPE + KV write then sees
        the normed q and k (the same op sequence as the reference model, so exact in fp32)."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "head":  # [n, heads, head_dim] normed over head_dim
            q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).reshape(n, self.q_size)
            k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, self.kv_size)
        elif self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return torch.cat([q.to(qkv.dtype), k.to(qkv.dtype), v], dim=-1)

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, backend) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 kv_size]
        if self.qk_norm or self.clip_qkv is not None:
            qkv = self.norm_qkv(qkv)
        # rotates q and k, writes k and v into the pool (one fused kernel on the kernel backend)
        q = backend.layer_ops.rope_write_kv(qkv, self, rope, k_cache, v_cache, meta, backend)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale, self.kv_scales,
                             window=self.window, softcap=self.softcap)  # [num_tokens, num_heads, head_dim]
        if self.kv_rotation is not None:  # v was stored rotated: the output back to the model's basis
            out = out @ self.kv_rotation.T
        out = self.o_proj(out.reshape(num_tokens, self.q_size))  # row-parallel: a partial sum
        return out if self.comm is None else self.comm.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU ``down(silu(gate x) * up x)`` or GeGLU (``spec.activation`` gelu_tanh: Gemma's
    tanh-approximated GELU), gate and up fused into one GEMM."""

    def __init__(self, spec: ModelSpec, shard: Shard = Shard(), comm: Comm | None = None,
                 intermediate_size: int | None = None):
        super().__init__()
        i0, i1 = shard.split(intermediate_size or spec.intermediate_size, "the intermediate size")
        self.intermediate_size = i1 - i0  # this rank's part
        self.comm = comm
        self.gelu = spec.activation == "gelu_tanh"
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops=TORCH_LAYER_OPS) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        act = ops.gelu_tanh_and_mul if self.gelu else ops.silu_and_mul  # [n, 2 i] -> [n, i]
        out = self.down_proj(act(self.gate_up_proj(x)))  # row-parallel: a partial sum
        return out if self.comm is None else self.comm.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward (a dense ``MLP`` or ``moe.MoE``), each with a residual.

    With ``spec.sandwich_norms`` (Gemma 2/3) the attention's and the MLP's outputs are normed too
    before their residual adds: ``post_attention_layernorm`` norms the attention's output,
    ``pre_feedforward_layernorm`` the MLP's input and ``post_feedforward_layernorm`` its output
    (the checkpoint's names)."""

    def __init__(self, spec: ModelSpec, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        h, eps, offset = spec.hidden_size, spec.rms_norm_eps, spec.norm_offset
        self.input_layernorm = RMSNorm(h, eps, offset)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)
        self.mlp = mlp

    def forward(self, normed, residual, rope, k_cache, v_cache, meta, backend, next_norm: RMSNorm):
        """``normed`` is this layer's input norm of ``residual``; returns the new residual and its
        norm by ``next_norm`` (the next layer's input norm, or the final one): each residual add
        is fused with the norm that follows it."""
        ops = backend.layer_ops
        h = self.self_attn(normed, rope, k_cache, v_cache, meta, backend)  # [n, hidden]
        if not self.sandwich:
            residual, normed = ops.add_rms_norm(h, residual, self.post_attention_layernorm)
            return ops.add_rms_norm(self.mlp(normed, ops), residual, next_norm)
        h = ops.rms_norm(h, self.post_attention_layernorm)
        residual, normed = ops.add_rms_norm(h, residual, self.pre_feedforward_layernorm)
        h = ops.rms_norm(self.mlp(normed, ops), self.post_feedforward_layernorm)
        return ops.add_rms_norm(h, residual, next_norm)


class PackedLinear(nn.Module):
    """A linear layer whose weight is pre-packed for oneDNN (CPU, fp32).

    MKL's sgemm is slow for the skinny GEMMs of decode on many CPUs; oneDNN with a weight packed
    once at load time is about twice as fast at batch 8 here. Results differ from the dense path
    only by float rounding. oneDNN computes a one-row call in another order than calls of two
    rows or more (whose rows agree bit for bit, whatever else is in the call): a batch-invariant
    layer (``batch_invariant``, set by the runner) computes a lone row as a call of two.
    """

    batch_invariant = False

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and x.dim() == 2 and x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), self.packed, self.bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def cpu_linear_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PACKED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def pack_linears_for_cpu(model: "CausalLM") -> None:
    """Swap every dense projection (and the LM head) for its oneDNN-packed form; frees the dense
    copies. Quantized layers, a quantized head and routers are left as they are; a mixture of
    experts packs each expert (``moe.MoE.pack_for_cpu``)."""
    for layer in model.layers:
        for parent in list(layer.modules()):
            if hasattr(parent, "pack_for_cpu"):
                parent.pack_for_cpu()
            for attr in PACKED_PROJECTIONS:
                if type(getattr(parent, attr, None)) is nn.Linear:  # quantized layers have their own kernels
                    setattr(parent, attr, PackedLinear(getattr(parent, attr)))
    if model.packed_lm_head is not None:
        return
    rows = model.embed_tokens.weight.shape[0]  # this rank's part of the vocabulary
    head = model.lm_head or nn.Linear(model.spec.hidden_size, rows, bias=False, device="meta")
    if model.lm_head is None:  # tied: the embedding table stays for lookups, the head gets a packed copy
        head.weight = model.embed_tokens.weight
    model.packed_lm_head = PackedLinear(head)
    model.lm_head = None


class VocabEmbedding(nn.Embedding):
    """The embedding table, or this rank's rows of it: ids outside them look up zeros and the
    all-reduce adds the rank that holds them (exactly: the other terms are zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard = Shard(), comm: Comm | None = None):
        self.vocab_start, self.vocab_end, rows = shard.vocab(vocab_size)
        super().__init__(rows, hidden_size)
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.comm.all_reduce(x)


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings or not).

    A family subclasses it: ``model_types``/``architectures`` (what ``registry`` matches),
    ``spec_from_config`` (its extras), ``make_layer`` (its layer) and ``checkpoint_layout``.
    Whatever the family's layer, each layer's attention gets its window from
    ``spec.layer_windows`` here; ``local_rope`` (set by ``init_rope``, Gemma 3) is the RoPE table
    of the windowed layers when they have their own."""

    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()

    def __init__(self, spec: ModelSpec, hf_config, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__()
        self.spec = spec
        self.hf_config = hf_config
        self.shard = shard
        self.comm = comm if shard.size > 1 else None
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, shard, self.comm)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(spec.num_layers))
        for layer, window in zip(self.layers, spec.layer_windows):
            layer.self_attn.window = window
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        rows = self.embed_tokens.weight.shape[0]
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, rows, bias=False)
        self.packed_lm_head: nn.Module | None = None  # oneDNN-packed or quantized
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.local_rope: RopeTables | None = None
        # layers whose residual output each forward keeps in ``tapped`` (one [num_tokens, hidden]
        # tensor per tap, in this order): what an EAGLE draft head reads besides the final output
        self.taps: tuple[int, ...] = ()
        self.tapped: list[torch.Tensor] = []

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        return ModelSpec.from_hf_config(config)

    @staticmethod
    def checkpoint_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under the names ``checkpoint_layout`` reads (a family whose
        checkpoints nest the text model renames them)."""
        return state

    def extra_layout(self) -> dict[str, list[Part]]:
        """Parameters outside the decoder (a vision tower), as whole checkpoint tensors."""
        return {}

    def make_layer(self, index: int) -> DecoderLayer:
        return DecoderLayer(self.spec, Attention(self.spec, self.shard, self.comm), MLP(self.spec, self.shard, self.comm))

    @classmethod
    def checkpoint_layout(cls, spec: ModelSpec, shard: Shard = Shard()) -> dict[str, list[Part]]:
        """Our parameter names -> the checkpoint slices that make this rank's copy."""
        layout = base_layout(spec, shard)
        for i in range(spec.num_layers):
            layout.update(attention_layout(spec, shard, i))
            layout.update(mlp_layout(spec, shard, f"model.layers.{i}.mlp.", f"layers.{i}.mlp."))
        return layout

    def stack_layout(self, kv_caches) -> StackLayout | None:
        """This model's layers as ``csrc/stack.c`` reads them, or None when they are not plain."""
        l0, last = self.layers[0], self.layers[-1]
        key = (id(kv_caches), len(kv_caches), id(l0.self_attn.qkv_proj),
               id(getattr(l0.self_attn.qkv_proj, "weight_packed", None)), id(getattr(last, "mlp", None)),
               id(getattr(getattr(last, "mlp", None), "down_proj", None)), id(self.rope_cos))
        cached = self.__dict__.get("_stack_layout")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_stack_layout"] = (key, StackLayout.of(self, kv_caches))
        return cached[1]

    def __getstate__(self) -> dict:
        state = super().__getstate__().copy()
        state.pop("_stack_layout", None)  # addresses of this process
        return state

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        cos, sin = rope_cos_sin(self.hf_config, self.spec.max_position_embeddings, dtype)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        """``embeds``: (rows, values) that replace those rows' token embeddings (an image's
        placeholders get the vision tower's output), before the first layer, on every path."""
        ops = backend.layer_ops
        residual = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if self.spec.embed_scale != 1.0:  # Gemma: times sqrt(hidden) in the activations' dtype, as transformers
            residual = residual * torch.tensor(self.spec.embed_scale, dtype=residual.dtype)
        if embeds is not None:
            residual = residual.index_copy(0, embeds[0], embeds[1].to(residual.dtype))
        stack = getattr(backend, "decode_stack", None)  # the CPU kernels' whole stack in one call
        if stack is not None:
            normed = stack(self, residual, positions, kv_caches, meta)
            if normed is not None:
                return normed
        rope = ops.rope_inputs(self, positions)
        local = rope if self.local_rope is None else ops.rope_inputs(self.local_rope, positions)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        normed = ops.rms_norm(residual, self.layers[0].input_layernorm)
        tapped = {}
        for i, (layer, (k_cache, v_cache), next_norm) in enumerate(zip(self.layers, kv_caches, norms)):
            r = local if layer.self_attn.window else rope
            residual, normed = layer(normed, residual, r, k_cache, v_cache, meta, backend, next_norm)
            if i in self.taps:  # a copy: some kernels update the residual in place
                tapped[i] = residual.float().clone()
        if self.taps:
            self.tapped = [tapped[i] for i in self.taps]
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab_size] fp32
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        if self.comm is not None:
            # every rank gets the whole rows (all of them run the same prompt-logprob code); padding goes
            logits = self.comm.all_gather_cat(logits)[:, : self.spec.vocab_size]
        if self.spec.final_softcap:  # Gemma 2: c tanh(logits / c)
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


@dataclass
class StackLayout:
    """A plain model's layers as ``csrc/stack.c`` reads them (the CPU kernels' whole stack in one
    call): ``stack``, folio.h's ``folio_stack``, whose layers hold each projection's tiles, the
    norms and the KV pool; ``keepalive``: what its addresses point into."""

    stack: object  # cpu_kernels.Stack
    layers: object  # cpu_kernels.Layer * num_layers
    keepalive: tuple

    @staticmethod
    def plain(model) -> bool:
        """Pre-norm layers, dense gated MLPs, the four projections quantized for folio's kernels, no
        bias, q/k norm, clipping, rotation, LoRA, sharding or second RoPE table, an fp32 pool."""
        if model.local_rope is not None or model.comm is not None:
            return False
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(layer) is not DecoderLayer or layer.sandwich or type(attn) is not Attention or type(mlp) is not MLP:
                return False
            if attn.qk_norm or attn.clip_qkv is not None or attn.kv_rotation is not None or attn.comm is not None \
                    or mlp.comm is not None or tuple(attn.kv_scales) != (1.0, 1.0):
                return False
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if type(proj) is not QuantLinear or proj.bias is not None or proj.weight_packed is None \
                        or not proj.int8_activations:
                    return False
        return True

    @classmethod
    def of(cls, model, kv_caches) -> StackLayout | None:
        from folio.core.executor.kernels import cpu_kernels as ck

        if not cls.plain(model):
            return None
        layers = model.layers
        a0, m0 = layers[0].self_attn, layers[0].mlp
        if len({(layer.self_attn.scale, layer.self_attn.softcap, layer.mlp.intermediate_size)
                for layer in layers}) != 1:
            return None
        table = (ck.Layer * len(layers))()
        nexts = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
        for i, (layer, (k_cache, v_cache), nxt) in enumerate(zip(layers, kv_caches, nexts)):
            attn, mlp = layer.self_attn, layer.mlp
            if k_cache.dtype != torch.float32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                return None
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, nxt):
                if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
                    return None
            kv = ck.KV(k=k_cache.data_ptr(), v=v_cache.data_ptr(), num_blocks=k_cache.shape[0],
                       block_size=k_cache.shape[1], num_kv_heads=k_cache.shape[2], head_dim=k_cache.shape[3])
            table[i] = ck.Layer(qkv=attn.qkv_proj.weight_packed.struct, o=attn.o_proj.weight_packed.struct,
                                gate_up=mlp.gate_up_proj.weight_packed.struct, down=mlp.down_proj.weight_packed.struct,
                                post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                                next_norm=nxt.weight.data_ptr(), kv=kv, window=attn.window, gelu=int(mlp.gelu))
        stack = ck.Stack(num_layers=len(layers), layers=ctypes.addressof(table), hidden=model.spec.hidden_size,
                         num_heads=a0.num_heads, head_dim=a0.head_dim, intermediate=m0.intermediate_size,
                         eps=float(model.norm.eps), scale=float(a0.scale), softcap=float(a0.softcap),
                         first_norm=layers[0].input_layernorm.weight.data_ptr(), cos_table=model.rope_cos.data_ptr(),
                         sin_table=model.rope_sin.data_ptr(), rope_len=model.rope_cos.shape[0], act_bf16=0,
                         passes=QuantLinear.passes, threads=1)
        keep = (kv_caches, [layer.input_layernorm.weight for layer in layers], model.norm.weight, model.rope_cos,
                model.rope_sin)
        return cls(stack, table, keep)


def base_layout(spec: ModelSpec, shard: Shard) -> dict[str, list[Part]]:
    """Embeddings, final norm and LM head (this rank's vocabulary rows)."""
    v0, v1, _ = shard.vocab(spec.vocab_size)
    layout = {"embed_tokens.weight": [("model.embed_tokens.weight", 0, v0, v1)],
              "norm.weight": [("model.norm.weight", None, 0, 0)]}
    if not spec.tie_word_embeddings:
        layout["lm_head.weight"] = [("lm_head.weight", 0, v0, v1)]
    return layout


def attention_layout(spec: ModelSpec, shard: Shard, i: int) -> dict[str, list[Part]]:
    """Layer ``i``'s attention (q/k/v fused, this rank's heads), its q/k norms and both layer norms."""
    hd = spec.head_dim
    h0, h1 = shard.split(spec.num_heads, "the number of attention heads")
    kv0, kv1 = shard.kv_heads(spec.num_heads, spec.num_kv_heads)
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    attn = src + "self_attn."
    heads = {"q": (h0 * hd, h1 * hd), "k": (kv0 * hd, kv1 * hd), "v": (kv0 * hd, kv1 * hd)}
    layout = {dst + "self_attn.qkv_proj.weight": [(f"{attn}{p}_proj.weight", 0, *heads[p]) for p in "qkv"],
              dst + "self_attn.o_proj.weight": [(attn + "o_proj.weight", 1, h0 * hd, h1 * hd)]}
    if spec.qkv_bias:
        layout[dst + "self_attn.qkv_proj.bias"] = [(f"{attn}{p}_proj.bias", 0, *heads[p]) for p in "qkv"]
    if spec.qk_norm == "head":  # one head's weights, the same for every head: replicated
        for p in "qk":
            layout[f"{dst}self_attn.{p}_norm.weight"] = [(f"{attn}{p}_norm.weight", None, 0, 0)]
    elif spec.qk_norm == "full":  # over the whole projection: this rank's heads' part
        layout[dst + "self_attn.q_norm.weight"] = [(attn + "q_norm.weight", 0, *heads["q"])]
        layout[dst + "self_attn.k_norm.weight"] = [(attn + "k_norm.weight", 0, *heads["k"])]
    norms = ("input_layernorm", "post_attention_layernorm")
    if spec.sandwich_norms:
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    for norm in norms:
        layout[f"{dst}{norm}.weight"] = [(f"{src}{norm}.weight", None, 0, 0)]
    return layout


def mlp_layout(spec: ModelSpec, shard: Shard, src: str, dst: str, names=("gate_proj", "up_proj", "down_proj"),
               intermediate_size: int | None = None) -> dict[str, list[Part]]:
    """A dense MLP at checkpoint prefix ``src``: gate and up fused (this rank's rows), down (its columns)."""
    i0, i1 = shard.split(intermediate_size or spec.intermediate_size, "the intermediate size")
    gate, up, down = names
    return {dst + "gate_up_proj.weight": [(src + f"{p}.weight", 0, i0, i1) for p in (gate, up)],
            dst + "down_proj.weight": [(src + f"{down}.weight", 1, i0, i1)]}

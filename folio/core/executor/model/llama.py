"""Our own Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral, SmolLM2) over the paged KV pool.

The forward pass takes one flattened varlen batch (``input_ids``/``positions`` of every new token
of every scheduled sequence) and the per-layer K/V pools; attention goes through a backend
(``attention.TorchAttentionBackend`` or the CUDA one) that reads the pool through block tables.
Configs come from ``transformers``; so does the RoPE frequency table (every scaling type it knows,
llama3 included), so ours is the same as the reference implementation's.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up projections
are fused into one GEMM each (``loader.py`` concatenates them at load time).

With tensor parallelism (``parallel.Shard``) each rank builds the same modules at its shard's
sizes: its query and KV heads, its part of the intermediate size and of the vocabulary; ``comm``
sums the row-parallel outputs and gathers the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS
from folio.core.executor.parallel.comm import Comm, Shard

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, read from a ``transformers`` config."""

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

    @staticmethod
    def from_hf_config(config) -> "ModelSpec":
        model_type = getattr(config, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; folio runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (SwiGLU/silu only)")
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
        )


def rope_cos_sin(config, max_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` computed as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_scaling = 1.0
    elif rope_type in ("linear", "llama3", "yarn", "longrope"):
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_LAYER_OPS.rms_norm(x, self)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__()
        h0, h1 = shard.split(spec.num_heads, "the number of attention heads")
        kv0, kv1 = shard.kv_heads(spec.num_heads, spec.num_kv_heads)
        self.num_heads = h1 - h0  # this rank's query heads
        self.num_kv_heads = kv1 - kv0
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * spec.head_dim
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.kv_scales = (1.0, 1.0)  # an fp8 pool's (k_scale, v_scale), set by kv_quant's calibration
        self.kv_rotation: torch.Tensor | None = None  # an fp8 pool's basis for q, k and v (kv_quant)
        self.comm = comm
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata, backend) -> torch.Tensor:
        num_tokens = x.shape[0]
        # rotates q and k, writes k and v into the pool (one fused kernel on the kernel backend)
        q = backend.layer_ops.rope_write_kv(self.qkv_proj(x), self, rope, k_cache, v_cache, meta, backend)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale, self.kv_scales)  # [num_tokens, num_heads, head_dim]
        if self.kv_rotation is not None:  # v was stored rotated: the output back to the model's basis
            out = out @ self.kv_rotation.T
        out = self.o_proj(out.reshape(num_tokens, self.q_size))  # row-parallel: a partial sum
        return out if self.comm is None else self.comm.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__()
        i0, i1 = shard.split(spec.intermediate_size, "the intermediate size")
        self.intermediate_size = i1 - i0  # this rank's part
        self.comm = comm
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops=TORCH_LAYER_OPS) -> torch.Tensor:
        out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))  # row-parallel: a partial sum
        return out if self.comm is None else self.comm.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, shard, comm)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, shard, comm)

    def forward(self, normed, residual, rope, k_cache, v_cache, meta, backend, next_norm: RMSNorm):
        """``normed`` is this layer's input norm of ``residual``; returns the new residual and its
        norm by ``next_norm`` (the next layer's input norm, or the final one): each residual add
        is fused with the norm that follows it."""
        ops = backend.layer_ops
        h = self.self_attn(normed, rope, k_cache, v_cache, meta, backend)
        residual, normed = ops.add_rms_norm(h, residual, self.post_attention_layernorm)
        return ops.add_rms_norm(self.mlp(normed, ops), residual, next_norm)


class PackedLinear(nn.Module):
    """A linear layer whose weight is pre-packed for oneDNN (CPU, fp32).

    MKL's sgemm is slow for the skinny GEMMs of decode on many CPUs; oneDNN with a weight packed
    once at load time is about twice as fast at batch 8 here. Results differ from the dense path
    only by float rounding.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def cpu_linear_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears_for_cpu(model: "LlamaForCausalLM") -> None:
    """Swap every dense projection (and the LM head) for its oneDNN-packed form; frees the dense
    copies. Quantized layers and a quantized head are left as they are."""
    for layer in model.layers:
        for parent, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            if type(getattr(parent, attr)) is nn.Linear:  # quantized layers have their own kernels
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


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings or not)."""

    def __init__(self, spec: ModelSpec, hf_config, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__()
        self.spec = spec
        self.hf_config = hf_config
        self.shard = shard
        self.comm = comm if shard.size > 1 else None
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, shard, self.comm)
        self.layers = nn.ModuleList(DecoderLayer(spec, shard, self.comm) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        rows = self.embed_tokens.weight.shape[0]
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, rows, bias=False)
        self.packed_lm_head: nn.Module | None = None  # oneDNN-packed or quantized
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

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
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        ops = backend.layer_ops
        residual = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        rope = ops.rope_inputs(self, positions)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        normed = ops.rms_norm(residual, self.layers[0].input_layernorm)
        for layer, (k_cache, v_cache), next_norm in zip(self.layers, kv_caches, norms):
            residual, normed = layer(normed, residual, rope, k_cache, v_cache, meta, backend, next_norm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab_size] fp32
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        if self.comm is None:
            return logits
        # every rank gets the whole rows (all of them run the same prompt-logprob code); padding goes
        return self.comm.all_gather_cat(logits)[:, : self.spec.vocab_size]

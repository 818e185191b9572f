"""BERT (``model_type`` bert: ``BertModel`` checkpoints as sentence-transformers saves them), an
encoder-only embedding model: absolute position embeddings, post-LayerNorm layers with biased
q/k/v/o projections and an erf-GELU MLP, as transformers' ``modeling_bert.py`` defines them.

Attention is bidirectional: every token of an input sees every token of that input and none of
another's. So a prompt runs whole in one step (the scheduler never chunks it and the prefix cache
never serves it: ``PoolingParams.bidirectional``), and each layer attends its inputs' fresh q/k/v
directly (non-causal SDPA per input, from ``query_start_loc``); the KV pool is neither read nor
written. The output is the last layer's hidden states; ``pool_rows`` pools each input's tokens by
the checkpoint's mode (``pooling_mode``: mean or cls). Design notes: docs/serving-api.md (encoder-only models).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.model.layers import CausalLM, ModelSpec, Part, PackedLinear
from folio.core.executor.parallel.comm import Comm, Shard

POOLING_MODES = ("mean", "cls")


# sentence-transformers' older pooling config (one bool per mode, all-MiniLM-L6-v2's) -> its mode names
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def sentence_pooling(folder: Path) -> tuple[str, bool]:
    """(pooling mode, whether a ``Normalize`` module follows) from a sentence-transformers folder's
    ``modules.json`` and its pooling module's ``config.json`` (``pooling_mode``, or the older
    ``pooling_mode_*_tokens`` bools); without them, mean pooling, normalised (docs/serving-api.md)."""
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return "mean", True
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    for m in modules:
        if not m.get("type", "").endswith("Pooling"):
            continue
        config = json.loads((folder / m.get("path", "") / "config.json").read_text())
        modes = config.get("pooling_mode") or [mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)]
        modes = [modes] if isinstance(modes, str) else list(modes)
        if len(modes) != 1 or modes[0] not in POOLING_MODES:
            raise ValueError(f"unsupported sentence-transformers pooling {modes} in {folder / m.get('path', '')}: "
                             f"folio pools by one of {', '.join(POOLING_MODES)}")
        return modes[0], normalize
    return "mean", normalize


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type 0 embeddings, then LayerNorm."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertAttention(nn.Module):
    """Fused q/k/v (biased), non-causal attention within each input, the output projection."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.num_heads = self.num_kv_heads = spec.num_heads  # (the runner sizes its pool by num_kv_heads)
        self.head_dim = spec.head_dim
        self.size = spec.num_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, 3 * self.size)
        self.o_proj = nn.Linear(self.size, spec.hidden_size)

    def forward(self, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """``bounds``: each input's first token and the end, ``query_start_loc`` on the host."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3).unbind(0)
        out = torch.empty(self.num_heads, n, self.head_dim, dtype=x.dtype, device=x.device)
        for start, end in zip(bounds[:-1], bounds[1:]):  # [heads, tokens, head_dim] per input
            out[:, start:end] = F.scaled_dot_product_attention(q[:, start:end], k[:, start:end], v[:, start:end],
                                                               is_causal=False, scale=self.scale)
        return self.o_proj(out.transpose(0, 1).reshape(n, self.size))


class BertMLP(nn.Module):
    """``down(gelu(up x))`` with biases (erf GELU, transformers' ``gelu``)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def pack_for_cpu(self) -> None:  # (``pack_linears_for_cpu`` packs ``down_proj`` by its name)
        if type(self.up_proj) is nn.Linear:
            self.up_proj = PackedLinear(self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class BertLayer(nn.Module):
    """Post-norm: ``LN(x + attn(x))``, then ``LN(h + mlp(h))``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.self_attn = BertAttention(spec)
        self.attention_norm = nn.LayerNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = BertMLP(spec)
        self.output_norm = nn.LayerNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        h = self.attention_norm(x + self.self_attn(x, bounds))
        return self.output_norm(h + self.mlp(h))


class NoLMHead(nn.Module):
    """Where a decoder keeps its packed LM head: an encoder-only model has none to pack or call."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("an encoder-only model has no LM head: it serves --task embed only")


class BertModel(CausalLM):
    """Embeddings -> [attention -> LN -> MLP -> LN] x L; the last layer's hidden states, pooled per input.

    ``CausalLM`` is the interface the runner drives (its spec, layers, pool sizing, the packed
    head's slot); none of the decoder's modules are built (``nn.Module.__init__`` only)."""

    model_types = ("bert",)
    architectures = ("BertModel",)
    encoder_only = True

    def __init__(self, spec: ModelSpec, hf_config, shard: Shard = Shard(), comm: Comm | None = None):
        nn.Module.__init__(self)
        self.spec, self.hf_config, self.shard, self.comm = spec, hf_config, shard, None
        self.embeddings = BertEmbeddings(hf_config)
        self.layers = nn.ModuleList(BertLayer(spec) for _ in range(spec.num_layers))
        self.lm_head = None
        self.packed_lm_head: nn.Module | None = NoLMHead()
        self.rope_cos = self.rope_sin = None
        self.local_rope = None
        self.taps, self.tapped = (), []
        self.pooling_mode, self.normalize = "mean", True  # the checkpoint's (``read_pooling``)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError("BERT as a decoder (is_decoder, cross-attention) is not supported: encoders only")
        position = getattr(config, "position_embedding_type", None) or "absolute"  # (older configs name it)
        if position != "absolute":
            raise ValueError(f"unsupported BERT position_embedding_type {position!r} (absolute only)")
        act = getattr(config, "hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"unsupported BERT activation {act!r} (gelu only)")
        if config.hidden_size % config.num_attention_heads:
            raise ValueError("the hidden size is not a multiple of the number of attention heads")
        return ModelSpec(
            model_type="bert", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads, rms_norm_eps=config.layer_norm_eps,
            max_position_embeddings=config.max_position_embeddings, qkv_bias=True, tie_word_embeddings=True,
            activation="gelu")

    @staticmethod
    def checkpoint_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint of a BERT with a head (``bert.`` prefixed names) read as its ``BertModel``."""
        if any(k.startswith("embeddings.") for k in state):
            return state
        return {k[len("bert."):]: v for k, v in state.items() if k.startswith("bert.")}

    @classmethod
    def checkpoint_layout(cls, spec: ModelSpec, shard: Shard = Shard()) -> dict[str, list[Part]]:
        layout: dict[str, list[Part]] = {}
        for name in ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
                     "LayerNorm.weight", "LayerNorm.bias"):
            layout[f"embeddings.{name}"] = [(f"embeddings.{name}", None, 0, 0)]
        for i in range(spec.num_layers):
            src, dst = f"encoder.layer.{i}.", f"layers.{i}."
            ours = {"self_attn.o_proj": "attention.output.dense", "attention_norm": "attention.output.LayerNorm",
                    "mlp.up_proj": "intermediate.dense", "mlp.down_proj": "output.dense",
                    "output_norm": "output.LayerNorm"}
            for p in ("weight", "bias"):
                layout[f"{dst}self_attn.qkv_proj.{p}"] = [(f"{src}attention.self.{n}.{p}", None, 0, 0)
                                                          for n in ("query", "key", "value")]
                for mine, theirs in ours.items():
                    layout[f"{dst}{mine}.{p}"] = [(f"{src}{theirs}.{p}", None, 0, 0)]
        return layout

    def read_pooling(self, folder: Path) -> None:
        """The checkpoint's pooling (``sentence_pooling``), read once the model is built."""
        self.pooling_mode, self.normalize = sentence_pooling(Path(folder))

    def init_rope(self, dtype: torch.dtype, device: torch.device) -> None:
        pass  # absolute position embeddings: no RoPE tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                backend, embeds=None) -> torch.Tensor:  # [num_tokens, hidden_size], the last layer's
        """Every input must be whole in this step (nothing cached before it): its tokens see each other."""
        if meta.seq_lens_list != meta.query_lens_list:
            raise ValueError("an encoder-only model computes each input whole in one step: a step continued an "
                             "input (a chunked prompt or a prefix-cache hit)")
        bounds = [0]
        for n in meta.query_lens_list:
            bounds.append(bounds[-1] + n)
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, bounds)
        return x

    def pool_rows(self, hidden: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Each pooled input's vector ``[num_inputs, hidden]`` from its tokens ``first..last``
        (indices into the step's tokens): their mean, or the first ([CLS])."""
        if self.pooling_mode == "cls":
            return hidden.index_select(0, first)
        lengths = last - first + 1
        owner = torch.repeat_interleave(torch.arange(len(first), device=hidden.device), lengths)
        rows = torch.cat([torch.arange(int(a), int(b) + 1, device=hidden.device) for a, b in zip(first, last)])
        sums = torch.zeros(len(first), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        sums.index_add_(0, owner, hidden.index_select(0, rows))
        return sums / lengths.unsqueeze(1).to(hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.packed_lm_head(hidden)

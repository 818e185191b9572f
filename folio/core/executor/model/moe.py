"""The mixture-of-experts feed-forward block and ``MoECausalLM``, the decoder stack the MoE
families subclass (mixtral.py, qwen2_moe.py, qwen3_moe.py, olmoe.py), with the spec and the
checkpoint layout they share.

Routing: softmax over the router's logits (fp32), the top-k experts of each token, optionally
renormalised to sum to 1 (``norm_topk_prob``; Mixtral always does). Execution groups tokens by
expert: the (token, slot) pairs are sorted by expert id, each expert runs one GEMM pair over its
contiguous run of rows, and the rows are scattered back with their routing weights
(``index_add_``). The Python loop is over experts, never over tokens. On the CPU in fp32 each
expert's two weights are oneDNN-packed once at load (``pack_for_cpu``), as the dense layers are.

Qwen2-MoE adds a shared expert (a dense MLP every token goes through), scaled by
``sigmoid(shared_expert_gate(x))``.

MoE models run on the CPU, unquantized, on one rank (``registry.check_runtime`` says so at start).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS
from folio.core.executor.model.layers import (
    MLP, Attention, CausalLM, DecoderLayer, ModelSpec, PackedLinear, Part, attention_layout, base_layout, mlp_layout,
)
from folio.core.executor.parallel.comm import Shard


def moe_spec(config, *, num_experts: int, norm_topk_prob: bool, moe_intermediate_size: int,
             shared_expert_intermediate_size: int = 0, **extras) -> ModelSpec:
    """The dense spec plus the experts; which layers are sparse follows Qwen-MoE's
    ``decoder_sparse_step``/``mlp_only_layers`` (every layer for configs without them)."""
    spec = ModelSpec.from_hf_config(config)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(spec.num_layers))
    return dataclasses.replace(
        spec, num_experts=num_experts, num_experts_per_tok=config.num_experts_per_tok, norm_topk_prob=norm_topk_prob,
        moe_intermediate_size=moe_intermediate_size, shared_expert_intermediate_size=shared_expert_intermediate_size,
        moe_layers=moe_layers, **extras)


class MoE(nn.Module):
    """Router + ``num_experts`` SwiGLU experts (+ an optional gated shared expert)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
        self.top_k, self.norm_topk_prob = spec.num_experts_per_tok, spec.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))  # each expert's gate and up rows
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        self.num_experts = e
        self.packed_experts: nn.ModuleList | None = None  # per expert (gate_up, down), oneDNN-packed
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = MLP(spec, intermediate_size=spec.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts ``[n, k]`` and their weights ``[n, k]`` (x's dtype)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, num_experts]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def expert(self, e: int):
        """Expert ``e``'s (gate_up, down) projections as callables: [m, hidden] -> [m, 2 i], [m, i] -> [m, hidden]."""
        if self.packed_experts is not None:
            return self.packed_experts[e]
        return (lambda x: F.linear(x, self.experts_gate_up[e])), (lambda x: F.linear(x, self.experts_down[e]))

    def pack_for_cpu(self) -> None:
        """Each expert's weights oneDNN-packed (``layers.pack_linears_for_cpu`` calls it); the
        stacked copies go."""

        def packed(weight: torch.Tensor) -> PackedLinear:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(weight, requires_grad=False)
            return PackedLinear(linear)

        self.packed_experts = nn.ModuleList(
            nn.ModuleList([packed(gu), packed(d)]) for gu, d in zip(self.experts_gate_up, self.experts_down))
        self.experts_gate_up = self.experts_down = None

    def forward(self, x: torch.Tensor, ops=TORCH_LAYER_OPS) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        n, k = x.shape[0], self.top_k
        experts, weights = self.route(x)
        flat = experts.reshape(-1)  # [n k]: slot j of token t at t k + j
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens ascending in each
        token = order // k  # [n k] the token of each sorted slot
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[token]  # [n k, hidden], expert 0's rows first
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):  # one GEMM pair per expert over its rows
            if count:
                seg = slice(start, start + count)
                gate_up, down = self.expert(e)
                out[seg] = down(ops.silu_and_mul(gate_up(rows[seg])).to(x.dtype))  # via [count, i]
                start += count
        out *= weights.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros_like(x).index_add_(0, token, out)  # [n, hidden]: each token's k slots summed
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        return y


def moe_layout(spec: ModelSpec, src: str, dst: str, router: str, expert: str,
               names=("gate_proj", "up_proj", "down_proj")) -> dict[str, list[Part]]:
    """The checkpoint's per-expert tensors (``{src}{expert}.{e}.{name}.weight``) stacked into ours;
    the router is ``{src}{router}.weight``; a shared expert is ``shared_expert`` and its gate."""
    gate, up, down = names
    experts = [f"{src}{expert}.{e}." for e in range(spec.num_experts)]
    layout = {dst + "gate.weight": [(f"{src}{router}.weight", None, 0, 0)],
              dst + "experts_gate_up": [(f"{p}{name}.weight", None, 0, 0) for p in experts for name in (gate, up)],
              dst + "experts_down": [(f"{p}{down}.weight", None, 0, 0) for p in experts]}
    if spec.shared_expert_intermediate_size:
        layout.update(mlp_layout(spec, Shard(), src + "shared_expert.", dst + "shared_expert.",
                                 intermediate_size=spec.shared_expert_intermediate_size))
        layout[dst + "shared_expert_gate.weight"] = [(src + "shared_expert_gate.weight", None, 0, 0)]
    return layout


class MoECausalLM(CausalLM):
    """A decoder whose sparse layers (``spec.moe_layers``) have ``MoE`` for their MLP.

    The checkpoint keeps a layer's block at ``model.layers.{i}.{ckpt_block}.`` with the router
    ``gate`` and the experts ``experts.{e}.`` named ``ckpt_expert_names`` (gate, up, down)."""

    ckpt_block = "mlp"
    ckpt_expert_names = ("gate_proj", "up_proj", "down_proj")

    def make_layer(self, index: int) -> DecoderLayer:
        spec = self.spec
        mlp = MoE(spec) if spec.moe_layers[index] else MLP(spec, self.shard, self.comm)
        return DecoderLayer(spec, Attention(spec, self.shard, self.comm), mlp)

    @classmethod
    def checkpoint_layout(cls, spec: ModelSpec, shard: Shard = Shard()) -> dict[str, list[Part]]:
        layout = base_layout(spec, shard)
        for i in range(spec.num_layers):
            layout.update(attention_layout(spec, shard, i))
            src, dst = f"model.layers.{i}.{cls.ckpt_block}.", f"layers.{i}.mlp."
            if spec.moe_layers[i]:
                layout.update(moe_layout(spec, src, dst, "gate", "experts", cls.ckpt_expert_names))
            else:
                layout.update(mlp_layout(spec, shard, src, dst))
        return layout

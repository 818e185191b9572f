"""The mixture-of-experts feed-forward block and ``MoECausalLM``, the decoder stack the MoE
families subclass (mixtral.py, qwen2_moe.py, qwen3_moe.py, olmoe.py), with the spec and the
checkpoint layout they share.

More in docs/modules.md (folio/core/executor/model/moe.py).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from folio.core.executor.kernels import moe_kernels
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS
from folio.core.executor.model.layers import (
    MLP, Attention, CausalLM, DecoderLayer, ModelSpec, PackedLinear, Part, attention_layout, base_layout, mlp_layout,
)
from folio.core.executor.parallel.comm import Comm, Shard
from folio.core.executor.quant.formats import quantize_int4, quantize_int8
from folio.core.executor.quant.linear import QuantLinear


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
    """Router + ``num_experts`` SwiGLU experts (+ an optional gated shared expert); with a
    ``shard`` of more than one rank, this rank's slice of each expert (``comm`` sums the output)."""

    def __init__(self, spec: ModelSpec, shard: Shard = Shard(), comm: Comm | None = None):
        super().__init__()
        i0, i1 = shard.split(spec.moe_intermediate_size, "the experts' intermediate size")
        e, h, i = spec.num_experts, spec.hidden_size, i1 - i0  # i: this rank's part of each expert
        self.top_k, self.norm_topk_prob = spec.num_experts_per_tok, spec.norm_topk_prob
        self.comm = comm
        self.gate = nn.Linear(h, e, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))  # each expert's gate and up rows
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        self.num_experts, self.intermediate_size = e, i
        self.packed_experts: nn.ModuleList | None = None  # per expert (gate_up, down): oneDNN-packed or quantized
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_intermediate_size:
            # comm None: its partial sum joins the routed experts' before the one all-reduce
            self.shared_expert = MLP(spec, shard, None, intermediate_size=spec.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts ``[n, k]`` and their weights ``[n, k]`` (fp32; the router in
        the model's dtype, whatever the activations')."""
        logits = F.linear(x.to(self.gate.weight.dtype), self.gate.weight)  # [n, num_experts]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(self.gate.weight.dtype)

    def expert(self, e: int):
        """Expert ``e``'s (gate_up, down) projections as callables: [m, hidden] -> [m, 2 i], [m, i] -> [m, hidden]."""
        if self.packed_experts is not None:
            return self.packed_experts[e]
        return (lambda x: F.linear(x, self.experts_gate_up[e])), (lambda x: F.linear(x, self.experts_down[e]))

    def _per_expert(self, make) -> None:
        """``packed_experts`` from each expert's stacked weights (``make(weight)`` -> a layer); the
        stacked copies go."""
        self.packed_experts = nn.ModuleList(
            nn.ModuleList([make(gu), make(d)]) for gu, d in zip(self.experts_gate_up, self.experts_down))
        self.experts_gate_up = self.experts_down = None

    def pack_for_cpu(self) -> None:
        """Each expert's weights oneDNN-packed (``layers.pack_linears_for_cpu`` calls it); quantized
        experts stay as they are."""
        if self.packed_experts is not None:
            return

        def packed(weight: torch.Tensor) -> PackedLinear:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(weight, requires_grad=False)
            return PackedLinear(linear)

        self._per_expert(packed)

    def quantize_experts(self, method: str, group_size: int) -> None:
        """Each expert's weights rounded to nearest (``int8`` per channel, ``int4`` in groups of
        ``group_size``) into the packed CPU layers (``quant.linear.quantize_model`` calls it)."""
        if method not in ("int8", "int4"):
            raise ValueError(f"mixture-of-experts weights quantize to int8 or int4, not {method}")
        rounded = quantize_int8 if method == "int8" else (lambda w: quantize_int4(w, group_size))
        self._per_expert(lambda w: QuantLinear(rounded(w.float())))

    kernel_launcher = None  # launches cuda/moe.cu (None: CuPy's on a GPU; the tests set the CPU emulation's)

    def forward(self, x: torch.Tensor, ops=TORCH_LAYER_OPS) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        if x.is_cuda or self.kernel_launcher is not None:
            y = moe_kernels.routed_experts(self, x)  # None where the kernels do not apply
            if y is not None:
                return self._add_shared_and_reduce(x, y, ops)
        n, k = x.shape[0], self.top_k
        dtype = self.gate.weight.dtype  # the model's: the output's and the sums' (x may be bf16 activations)
        experts, weights = self.route(x)
        flat = experts.reshape(-1)  # [n k]: slot j of token t at t k + j
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens ascending in each
        token = order // k  # [n k] the token of each sorted slot
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[token]  # [n k, hidden], expert 0's rows first
        segments = [(e, slice(start - count, start)) for e, count, start in
                    zip(range(self.num_experts), counts, itertools.accumulate(counts)) if count]
        gate_up = torch.empty((rows.shape[0], 2 * self.intermediate_size), dtype=x.dtype, device=x.device)
        for e, seg in segments:  # one GEMM pair per expert over its rows
            gate_up[seg] = self.expert(e)[0](rows[seg])
        act = ops.silu_and_mul(gate_up).to(x.dtype)  # [n k, i]
        out = torch.empty(rows.shape, dtype=dtype, device=x.device)
        for e, seg in segments:
            out[seg] = self.expert(e)[1](act[seg])
        out *= weights.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros((n, x.shape[1]), dtype=dtype, device=x.device)
        y.index_add_(0, token, out)  # [n, hidden]: each token's k slots summed
        return self._add_shared_and_reduce(x, y, ops)

    def _add_shared_and_reduce(self, x: torch.Tensor, y: torch.Tensor, ops) -> torch.Tensor:
        """The routed experts' ``y`` plus the gated shared expert (if any), summed over the ranks."""
        dtype = self.gate.weight.dtype
        if self.shared_expert is not None:
            gate = F.linear(x.to(dtype), self.shared_expert_gate.weight)  # [n, 1]
            y = y + torch.sigmoid(gate) * self.shared_expert(x, ops).to(dtype)
        return y if self.comm is None else self.comm.all_reduce(y)  # a partial sum on each rank


def moe_layout(spec: ModelSpec, src: str, dst: str, router: str, expert: str,
               names=("gate_proj", "up_proj", "down_proj"), shard: Shard = Shard()) -> dict[str, list[Part]]:
    """The checkpoint's per-expert tensors (``{src}{expert}.{e}.{name}.weight``) stacked into ours,
    this rank's slice of each (gate and up rows, down columns); the router is
    ``{src}{router}.weight``; a shared expert is ``shared_expert`` (sliced as a dense MLP) and its gate."""
    gate, up, down = names
    i0, i1 = shard.split(spec.moe_intermediate_size, "the experts' intermediate size")
    experts = [f"{src}{expert}.{e}." for e in range(spec.num_experts)]
    layout = {dst + "gate.weight": [(f"{src}{router}.weight", None, 0, 0)],
              dst + "experts_gate_up": [(f"{p}{name}.weight", 0, i0, i1) for p in experts for name in (gate, up)],
              dst + "experts_down": [(f"{p}{down}.weight", 1, i0, i1) for p in experts]}
    if spec.shared_expert_intermediate_size:
        layout.update(mlp_layout(spec, shard, src + "shared_expert.", dst + "shared_expert.",
                                 intermediate_size=spec.shared_expert_intermediate_size))
        layout[dst + "shared_expert_gate.weight"] = [(src + "shared_expert_gate.weight", None, 0, 0)]
    return layout


class MoECausalLM(CausalLM):
    """A decoder whose sparse layers (``spec.moe_layers``) have ``MoE`` for their MLP.

    The checkpoint keeps a layer's block at ``model.layers.{i}.{ckpt_block}.`` with the router
    ``gate`` and the experts ``experts.{e}.`` named ``ckpt_expert_names`` (gate, up, down)."""

    ckpt_block = "mlp"
    ckpt_expert_names = ("gate_proj", "up_proj", "down_proj")
    qk_norm = ""  # the family's q/k norm (``ModelSpec.qk_norm``)

    @classmethod
    def spec_from_config(cls, config) -> ModelSpec:
        """The spec from Qwen-MoE's config fields (``num_experts``, ``norm_topk_prob``,
        ``moe_intermediate_size``), as OLMoE and both Qwen MoE families name them, with the family's
        ``moe_options``."""
        options = {"num_experts": config.num_experts, "norm_topk_prob": bool(config.norm_topk_prob),
                   "moe_intermediate_size": getattr(config, "moe_intermediate_size", None), "qk_norm": cls.qk_norm}
        return moe_spec(config, **{**options, **cls.moe_options(config)})

    @classmethod
    def moe_options(cls, config) -> dict:
        """What the family reads from its config beyond the shared fields (overrides them)."""
        return {}

    def make_layer(self, index: int) -> DecoderLayer:
        spec = self.spec
        mlp = MoE(spec, self.shard, self.comm) if spec.moe_layers[index] else MLP(spec, self.shard, self.comm)
        return DecoderLayer(spec, Attention(spec, self.shard, self.comm), mlp)

    @classmethod
    def checkpoint_layout(cls, spec: ModelSpec, shard: Shard = Shard()) -> dict[str, list[Part]]:
        layout = base_layout(spec, shard)
        for i in range(spec.num_layers):
            layout.update(attention_layout(spec, shard, i))
            src, dst = f"model.layers.{i}.{cls.ckpt_block}.", f"layers.{i}.mlp."
            if spec.moe_layers[i]:
                layout.update(moe_layout(spec, src, dst, "gate", "experts", cls.ckpt_expert_names, shard))
            else:
                layout.update(mlp_layout(spec, shard, src, dst))
        return layout

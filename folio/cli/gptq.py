"""GPTQ (arXiv 2210.17323) for folio's symmetric per-channel int8 weights, on the CPU.

More in docs/modules.md (folio/cli/gptq.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from folio.cli.awq import run_calibration
from folio.core.executor.quant.formats import Int8Weight

DAMP = 0.01
BLOCK = 128


def input_hessians(model, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per ``nn.Linear`` name, ``X^T X`` ([K, K] fp64) over every input row the calibration text
    gives it."""
    hessians: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        h = hessians.get(name)
        hessians[name] = x.t() @ x if h is None else h.add_(x.t() @ x)

    run_calibration(model, seqs, add)
    return hessians


def gptq_quantize_int8(w: torch.Tensor, hessian: torch.Tensor, damp: float = DAMP, block: int = BLOCK) -> Int8Weight:
    """``w`` ([N, K]) as symmetric per-channel int8, its rounding errors compensated over ``hessian``."""
    w = w.double().clone()
    n, k = w.shape
    h = hessian.double().clone()
    scale = (w.abs().amax(1).clamp(min=1e-8) / 127.0)  # [N]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True)
    w, h = w[:, perm], h[perm][:, perm]
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.float64)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = w1[:, i]
            qc = (col / scale).round().clamp(-127, 127)
            q[:, i1 + i] = qc
            err = (col - qc * scale) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    out = torch.empty_like(q)
    out[:, perm] = q
    return Int8Weight(out.to(torch.int8), scale.float())


def gptq_int8(model, seqs: list[list[int]], progress: Callable[[], None] | None = None) -> dict[str, Int8Weight]:
    """HF linear name -> ``Int8Weight`` for every decoder projection of ``model`` (ours, dense fp32)."""
    spec = model.spec
    hessians = input_hessians(model, seqs)
    q_size, kv_size, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    splits = {"self_attn.qkv_proj": [("self_attn.q_proj", q_size), ("self_attn.k_proj", kv_size),
                                     ("self_attn.v_proj", kv_size)],
              "self_attn.o_proj": [("self_attn.o_proj", spec.hidden_size)],
              "mlp.gate_up_proj": [("mlp.gate_proj", inter), ("mlp.up_proj", inter)],
              "mlp.down_proj": [("mlp.down_proj", spec.hidden_size)]}
    quant: dict[str, Int8Weight] = {}
    for i, layer in enumerate(model.layers):
        for fused, parts in splits.items():
            module = layer.get_submodule(fused)
            wq = gptq_quantize_int8(module.weight.float(), hessians.pop(f"layers.{i}.{fused}"))
            start = 0
            for hf_name, rows in parts:
                quant[f"model.layers.{i}.{hf_name}.weight"] = Int8Weight(wq.q[start:start + rows],
                                                                         wq.scale[start:start + rows])
                start += rows
        if progress is not None:
            progress()
    return quant

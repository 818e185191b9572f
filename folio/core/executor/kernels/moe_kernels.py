"""Mixture-of-experts on CUDA: the launch wrapper of ``cuda/moe.cu`` (routing + grouped GEMM).

More in docs/modules.md (folio/core/executor/kernels/moe_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels.kernel_family import KernelFamily

SOURCE = "moe.cu"
# Mirrors constants of cuda/moe.cu (the tests check they agree).
ROUTE_THREADS = 128
MAX_EXPERTS = 256  # ROUTE_MAX_EXPERTS
MAX_TOP_K = 32
GROUP_THREADS = 256
PLAN_THREADS = 256
MOE_THREADS = 128
MOE_BM = 64
MOE_BN = 64
COMBINE_THREADS = 128
MOE_DTYPES = ("float16", "bfloat16")  # mma.sync inputs


@dataclass(frozen=True)
class MoeNames:
    """Name expressions of the MoE kernels for one activation dtype."""

    route: str
    group: str
    plan: str
    gate_up: str
    down: str
    combine: str


def _moe_names(dtype: str) -> MoeNames:
    t = ck.DTYPES[dtype]
    return MoeNames(route=f"folio::moe_route<{t}>", group="folio::moe_group", plan="folio::moe_plan",
                    gate_up=f"folio::moe_gemm<{t}, true>", down=f"folio::moe_gemm<{t}, false>",
                    combine=f"folio::moe_combine<{t}>")


FAMILY = KernelFamily("MoE kernels", SOURCE, MOE_DTYPES, _moe_names,
                         needs_cupy="mixture-of-experts models on a GPU run folio's MoE kernels", module_per_dtype=True)
moe_names = FAMILY.names  # the instances one activation dtype asks for
all_name_expressions = FAMILY.all_name_expressions
module_source = FAMILY.module_source
cupy_launcher = FAMILY.launcher


def shape_problems(hidden: int, intermediate: int, num_experts: int, top_k: int) -> list[str]:
    problems = []
    if hidden % 16:
        problems.append(f"hidden size {hidden} is not a multiple of 16")
    if intermediate % 16:
        problems.append(f"intermediate size {intermediate} (per expert, per rank) is not a multiple of 16")
    if not 1 <= num_experts <= MAX_EXPERTS:
        problems.append(f"{num_experts} experts (at most {MAX_EXPERTS})")
    if not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        problems.append(f"top-k {top_k} (1 to min({MAX_TOP_K}, the number of experts))")
    return problems


def check_moe_shapes(hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
    """Raises ``ValueError`` naming every size the kernels cannot take."""
    problems = shape_problems(hidden, intermediate, num_experts, top_k)
    if problems:
        raise ValueError("the MoE kernels cannot take this block: " + "; ".join(problems))


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def max_items(total: int, num_experts: int) -> int:
    """An upper bound of the work items: sum over experts of ceil(count / BM) <= total // BM + non-empty experts."""
    return total // MOE_BM + min(num_experts, total)


def route(launcher, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [n, k] int32, weights [n, k] fp32)`` from router logits ``[n, num_experts]``."""
    n, num_experts = logits.shape
    names = moe_names(str(logits.dtype).removeprefix("torch."))
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(n, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    warps = ROUTE_THREADS // 32
    launcher.launch(names, "route", (-(-n // warps), 1, 1), (ROUTE_THREADS, 1, 1),
                    [_ptr(ids), _ptr(weights), _ptr(logits), np.int32(n), np.int32(num_experts), np.int32(top_k),
                     np.int64(logits.stride(0)), np.int32(bool(renormalize))], logits.device)
    return ids, weights


def group(launcher, ids: torch.Tensor, num_experts: int, names: MoeNames) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm [n k], offsets [num_experts + 1])`` int32: the flat (token, slot) indices sorted by
    expert (stable), and where each expert's run starts."""
    total = ids.numel()
    perm = torch.empty(total, dtype=torch.int32, device=ids.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
    launcher.launch(names, "group", (num_experts, 1, 1), (GROUP_THREADS, 1, 1),
                    [_ptr(perm), _ptr(offsets), _ptr(ids), np.int32(total), np.int32(num_experts)], ids.device)
    return perm, offsets


def plan(launcher, offsets: torch.Tensor, total: int, names: MoeNames) -> tuple[torch.Tensor, torch.Tensor]:
    """``(items [max_items, 2], num_items [1])`` int32: (expert, first sorted row) per work item."""
    num_experts = offsets.numel() - 1
    items = torch.empty(max_items(total, num_experts), 2, dtype=torch.int32, device=offsets.device)
    num_items = torch.empty(1, dtype=torch.int32, device=offsets.device)
    launcher.launch(names, "plan", (1, 1, 1), (PLAN_THREADS, 1, 1),
                    [_ptr(items), _ptr(num_items), _ptr(offsets), np.int32(num_experts)], offsets.device)
    return items, num_items


def fused_moe(launcher, x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The routed experts' output ``[n, hidden]`` in x's dtype.

    ``x [n, hidden]`` (unit column stride), ``router_logits [n, E]`` (x's dtype),
    ``w_gate_up [E, 2 I, hidden]`` (each expert's gate rows, then its up rows), ``w_down [E, hidden, I]``."""
    n, hidden = x.shape
    num_experts, two_i, k_in = w_gate_up.shape
    inter = two_i // 2
    check_moe_shapes(hidden, inter, num_experts, top_k)
    dtype = str(x.dtype).removeprefix("torch.")
    names = moe_names(dtype)
    problems = [f"{name} is {t.dtype}" for name, t in (("router_logits", router_logits), ("w_gate_up", w_gate_up),
                                                        ("w_down", w_down)) if t.dtype != x.dtype]
    if k_in != hidden or tuple(w_down.shape) != (num_experts, hidden, inter) or router_logits.shape != (n, num_experts):
        problems.append(f"shapes x {tuple(x.shape)}, router_logits {tuple(router_logits.shape)}, "
                        f"w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)} do not agree")
    if problems:
        raise ValueError("fused_moe: " + "; ".join(problems) + f" (x is {x.dtype})")
    if n == 0:
        return x.new_empty(0, hidden)
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    device, total = x.device, n * top_k
    ids, weights = route(launcher, router_logits, top_k, renormalize)
    perm, offsets = group(launcher, ids, num_experts, names)
    items, num_items = plan(launcher, offsets, total, names)
    h = torch.empty(total, inter, dtype=x.dtype, device=device)  # sorted rows
    slots = torch.empty(total, hidden, dtype=x.dtype, device=device)  # by (token, slot)
    common = [_ptr(perm), _ptr(offsets), _ptr(items), _ptr(num_items)]
    launcher.launch(names, "gate_up", (items.shape[0], -(-inter // MOE_BN), 1), (MOE_THREADS, 1, 1),
                    [_ptr(h), _ptr(x), _ptr(w_gate_up), *common, np.int32(inter), np.int32(hidden),
                     np.int32(top_k), np.int64(x.stride(0))], device)
    launcher.launch(names, "down", (items.shape[0], -(-hidden // MOE_BN), 1), (MOE_THREADS, 1, 1),
                    [_ptr(slots), _ptr(h), _ptr(w_down), *common, np.int32(hidden), np.int32(inter),
                     np.int32(top_k), np.int64(inter)], device)
    y = torch.empty(n, hidden, dtype=x.dtype, device=device)
    launcher.launch(names, "combine", (n, 1, 1), (COMBINE_THREADS, 1, 1),
                    [_ptr(y), _ptr(slots), _ptr(weights), np.int32(top_k), np.int32(hidden)], device)
    return y


# ---------------------------------------------------------------------------- the MoE block's hook
def routed_experts(moe, x: torch.Tensor) -> torch.Tensor | None:
    """The routed experts' output for ``model.moe.MoE`` on these kernels, or None where they do not
    apply (activations or weights not f16/bf16 of one dtype, quantized/packed experts, sizes
    ``shape_problems`` names): the caller runs its torch path then."""
    w_gate_up, w_down = moe.experts_gate_up, moe.experts_down
    if w_gate_up is None or getattr(moe, "packed_experts", None) is not None:
        return None
    dtype = moe.gate.weight.dtype
    if str(dtype).removeprefix("torch.") not in MOE_DTYPES or x.dtype != dtype or w_gate_up.dtype != dtype \
            or x.dim() != 2 or shape_problems(x.shape[1], w_gate_up.shape[1] // 2, moe.num_experts, moe.top_k):
        return None
    launcher = getattr(moe, "kernel_launcher", None) or cupy_launcher(x.device)
    logits = torch.nn.functional.linear(x, moe.gate.weight)  # [n, E], the model's dtype (as MoE.route)
    return fused_moe(launcher, x, logits, w_gate_up, w_down, moe.top_k, moe.norm_topk_prob)

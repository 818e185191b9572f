"""The mixture-of-experts kernels (cuda/moe.cu): compiled for sm_80/sm_90 without spills, and run
in the CPU emulation against torch (routing exactly, the grouped GEMM against an fp32 reference of
the same 16-bit inputs). The ``gpu`` test runs the same cases on a GPU through CuPy.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from folio.core.executor.kernels import cuda_kernels as ck
from folio.core.executor.kernels import moe_kernels as mk
from tests.cuda.emu_runtime import EmulatedLauncher, build_unit_library, compile_problems


@pytest.fixture(scope="module")
def launcher() -> EmulatedLauncher:
    return EmulatedLauncher(build_unit_library("moe", mk.all_name_expressions(), ("mma.cuh", "common.cuh")))


# ---------------------------------------------------------------------------- references
def distinct_logits(n: int, num_experts: int, dtype, seed: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits without ties in the 16-bit dtype: each row a permutation of distinct values."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.linspace(-2.0, 2.0, num_experts)  # steps of >= 4/255: distinct in bf16 and f16
    rows = torch.stack([levels[torch.randperm(num_experts, generator=g)] for _ in range(n)])
    if bias is not None:
        rows = rows + bias
    return rows.to(dtype)


def reference_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = F.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def reference_moe(x, logits, w_gate_up, w_down, top_k, renormalize) -> torch.Tensor:
    """fp32 math on the same 16-bit inputs; one expert at a time (the obvious loop)."""
    ids, weights = reference_route(logits, top_k, renormalize)
    x, w_gate_up, w_down = x.float(), w_gate_up.float(), w_down.float()
    inter = w_gate_up.shape[1] // 2
    y = torch.zeros_like(x)
    for e in range(w_gate_up.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            gate_up = x[token] @ w_gate_up[e].t()
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y.index_add_(0, token, (h @ w_down[e].t()) * weights[token, slot].unsqueeze(-1))
    return y


def make_case(n, hidden, inter, num_experts, top_k, dtype, seed, bias=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return x, distinct_logits(n, num_experts, dtype, seed + 1, bias), w_gate_up, w_down


# ---------------------------------------------------------------------------- routing and grouping
@pytest.mark.parametrize("n,num_experts,top_k,renormalize,dtype", [
    (9, 7, 3, True, torch.bfloat16),
    (9, 7, 3, False, torch.bfloat16),
    (5, 40, 4, True, torch.float16),  # two experts per lane
    (3, 5, 1, False, torch.bfloat16),
    (2, 64, 8, True, torch.bfloat16),  # OLMoE's shape
])
def test_route_matches_torch(launcher, n, num_experts, top_k, renormalize, dtype):
    logits = distinct_logits(n, num_experts, dtype, seed=n + num_experts)
    ids, weights = mk.route(launcher, logits, top_k, renormalize)
    want_ids, want_weights = reference_route(logits, top_k, renormalize)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(n), rtol=1e-6, atol=1e-6)


def test_route_reads_a_strided_logit_view(launcher):
    wide = distinct_logits(6, 16, torch.bfloat16, seed=3)
    logits = wide[:, :11]  # token stride 16
    ids, weights = mk.route(launcher, logits, 2, True)
    want_ids, want_weights = reference_route(logits, 2, True)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)


def test_route_ties_go_to_the_lower_expert(launcher):
    """torch.topk's order among equal values is unspecified (on the CPU it is not the lower index);
    the kernel's is: the lower expert id first."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (12, 40), generator=g).to(torch.bfloat16)  # many ties
    ids, weights = mk.route(launcher, logits, 8, False)
    probs = F.softmax(logits.float(), dim=-1)
    for row, p in zip(ids.tolist(), probs):
        assert row == sorted(range(40), key=lambda j: (-p[j].item(), j))[:8]


@pytest.mark.parametrize("n,num_experts,top_k", [(1, 5, 2), (37, 9, 3), (130, 3, 2)])
def test_group_and_plan_match_a_stable_sort(launcher, n, num_experts, top_k):
    bias = torch.zeros(num_experts)
    bias[-1] = -10.0  # the last expert gets no token
    logits = distinct_logits(n, num_experts, torch.bfloat16, seed=n, bias=bias)
    names = mk.moe_names("bfloat16")
    ids, _ = mk.route(launcher, logits, top_k, False)
    perm, offsets = mk.group(launcher, ids, num_experts, names)
    flat = ids.reshape(-1).long()
    assert torch.equal(perm.long(), torch.argsort(flat, stable=True))
    counts = torch.bincount(flat, minlength=num_experts)
    assert counts[-1] == 0
    assert torch.equal(offsets.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    items, num_items = mk.plan(launcher, offsets, flat.numel(), names)
    want = [(e, int(offsets[e]) + r) for e in range(num_experts) for r in range(0, int(counts[e]), mk.MOE_BM)]
    assert int(num_items) == len(want) <= items.shape[0]
    assert [tuple(row) for row in items[:len(want)].tolist()] == want


# ---------------------------------------------------------------------------- the grouped GEMM
def check_fused(launcher, n, hidden, inter, num_experts, top_k, renormalize, dtype, seed, bias=None):
    x, logits, w_gate_up, w_down = make_case(n, hidden, inter, num_experts, top_k, dtype, seed, bias)
    y = mk.fused_moe(launcher, x, logits, w_gate_up, w_down, top_k, renormalize)
    assert y.dtype == dtype and y.shape == (n, hidden)
    want = reference_moe(x, logits, w_gate_up, w_down, top_k, renormalize)
    # 16-bit roundings: h before the down projection, each slot's row, the output
    err = (y.float() - want).abs().max().item()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # measured: 0.25-0.46% (bf16), 0.04% (f16)
    assert err <= tol * want.abs().max().item(), (err, want.abs().max().item())
    return y


def test_single_token(launcher):
    check_fused(launcher, 1, 32, 48, 5, 2, True, torch.bfloat16, seed=1)


def test_many_tokens_several_tiles_per_expert_and_empty_experts(launcher):
    # experts 0-2 take every token (70 rows each: two 64-row tiles), 3 and 4 none; the intermediate
    # size 80 spans two 64-column tiles of gate_up (the second partial), hidden 48 one partial tile
    bias = torch.tensor([8.0, 8.0, 8.0, -8.0, -8.0])
    launcher.launches.clear()
    check_fused(launcher, 70, 48, 80, 5, 3, False, torch.bfloat16, seed=2, bias=bias)
    grids = {name.split("<")[0]: grid for name, grid, _ in launcher.launches}
    assert grids["folio::moe_gemm"] == (70 * 3 // 64 + 5, 1, 1)  # the down GEMM, launched last


def test_odd_experts_top3_renormalised_f16(launcher):
    check_fused(launcher, 13, 64, 32, 7, 3, True, torch.float16, seed=3)


def test_deterministic(launcher):
    x, logits, w_gate_up, w_down = make_case(6, 32, 32, 3, 2, torch.bfloat16, seed=4)
    runs = [mk.fused_moe(launcher, x, logits, w_gate_up, w_down, 2, True) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_sizes_the_kernels_cannot_take_are_named():
    with pytest.raises(ValueError, match=r"hidden size 40 is not a multiple of 16.*intermediate size 24.*top-k 9"):
        mk.check_moe_shapes(40, 24, 8, 9)
    with pytest.raises(ValueError, match="300 experts"):
        mk.check_moe_shapes(64, 64, 300, 2)
    mk.check_moe_shapes(64, 48, 5, 2)
    with pytest.raises(ck.UnsupportedKernelError, match="float32"):
        mk.moe_names("float32")


# ---------------------------------------------------------------------------- compile
ARCHS = ("80", "90")


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills(arch):
    problems = compile_problems(mk.module_source(), "moe.cu", mk.all_name_expressions(), arch)
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)


def test_python_constants_match_the_kernel_source():
    source = mk.module_source()
    assert '#include "' not in source
    for name, value in (("ROUTE_THREADS", mk.ROUTE_THREADS), ("ROUTE_MAX_EXPERTS", mk.MAX_EXPERTS),
                        ("GROUP_THREADS", mk.GROUP_THREADS), ("PLAN_THREADS", mk.PLAN_THREADS),
                        ("MOE_THREADS", mk.MOE_THREADS), ("MOE_BM", mk.MOE_BM), ("MOE_BN", mk.MOE_BN),
                        ("COMBINE_THREADS", mk.COMBINE_THREADS)):
        assert re.search(rf"constexpr int {name} = {value};", source), name


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
def test_gpu_fused_moe_matches_torch():
    launcher = mk.cupy_launcher(torch.device("cuda"))
    for n, hidden, inter, e, k, norm, dtype in [(1, 32, 48, 5, 2, True, torch.bfloat16),
                                                 (300, 256, 96, 7, 3, False, torch.bfloat16),
                                                 (64, 2048, 768, 128, 8, True, torch.bfloat16),
                                                 (33, 128, 64, 9, 2, True, torch.float16)]:
        x, logits, w_gate_up, w_down = (t.cuda() for t in make_case(n, hidden, inter, e, k, dtype, seed=n))
        ids, weights = mk.route(launcher, logits, k, norm)
        want_ids, want_weights = reference_route(logits, k, norm)
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
        y = mk.fused_moe(launcher, x, logits, w_gate_up, w_down, k, norm)
        want = reference_moe(x, logits, w_gate_up, w_down, k, norm)
        err = (y.float() - want).abs().max().item()
        assert err <= 2e-2 * want.abs().max().item(), (n, hidden, inter, e, k, err)


# ---------------------------------------------------------------------------- through MoE.forward
@pytest.fixture(scope="module")
def tiny_moe_models(tmp_path_factory):
    """Loaded bf16 tiny checkpoints: Qwen2-MoE (5 experts, top-3, a shared expert, no
    renormalisation) and Qwen3-MoE (7 experts, top-2, renormalised)."""
    pytest.importorskip("transformers")  # write_tiny_model builds the checkpoints with it
    from folio.core.executor.model.loader import load_model
    from folio.testing.models import write_tiny_model

    models = {}
    for model_type, overrides in (
            ("qwen2_moe", dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=48,
                               shared_expert_intermediate_size=32, norm_topk_prob=False)),
            ("qwen3_moe", dict(num_experts=7, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                               head_dim=16))):
        path = write_tiny_model(tmp_path_factory.mktemp(model_type), model_type, **overrides)
        models[model_type] = load_model(path, torch.bfloat16, torch.device("cpu"))
    return models


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_moe_forward_runs_the_kernels_when_a_launcher_is_set(launcher, tiny_moe_models, model_type):
    from folio.core.executor.model.moe import MoE

    blocks = [m for m in tiny_moe_models[model_type].modules() if isinstance(m, MoE)]
    assert blocks
    g = torch.Generator().manual_seed(7)
    for block in blocks:
        for n in (1, 70):  # a decode row; a chunk
            x = torch.randn(n, block.gate.in_features, generator=g).to(torch.bfloat16)
            torch_path = block(x)
            launcher.launches.clear()
            block.kernel_launcher = launcher
            try:
                kernels = block(x)
            finally:
                block.kernel_launcher = None
            assert [name.split("<")[0] for name, *_ in launcher.launches] == [
                "folio::moe_route", "folio::moe_group", "folio::moe_plan", "folio::moe_gemm", "folio::moe_gemm",
                "folio::moe_combine"]
            reference = block.float()(x.float())  # the torch path in fp32 on the same bf16 weights
            block.to(torch.bfloat16)
            scale = reference.abs().max().item()
            assert kernels.dtype == torch.bfloat16
            err, torch_err = ((y.float() - reference).abs().max().item() for y in (kernels, torch_path))
            # measured: 0.4-1.1% of the largest output; the torch path's own bf16 roundings 0.5-1.1%
            # (Qwen2-MoE's shared expert and the final add are the same code on both paths)
            assert err <= max(1e-2 * scale, 1.05 * torch_err), (n, err / scale, torch_err / scale)


def test_moe_forward_keeps_the_torch_path_where_the_kernels_do_not_apply(launcher, tiny_moe_models):
    from folio.core.executor.model.moe import MoE

    block = next(m for m in tiny_moe_models["qwen3_moe"].modules() if isinstance(m, MoE))
    x = torch.randn(4, block.gate.in_features)
    try:
        block.float()  # fp32: no tensor-core instance
        block.kernel_launcher = launcher
        launcher.launches.clear()
        y = block(x)
        assert launcher.launches == []
        block.kernel_launcher = None
        assert torch.equal(y, block(x))
    finally:
        block.kernel_launcher = None
        block.to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_gpu_moe_forward_matches_the_cpu(tiny_moe_models, model_type):
    from folio.core.executor.model.moe import MoE

    block = next(m for m in tiny_moe_models[model_type].modules() if isinstance(m, MoE))
    x = torch.randn(200, block.gate.in_features, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    reference = block.float()(x.float())
    try:
        y = block.to("cuda", torch.bfloat16)(x.cuda())  # activations on CUDA: the kernels
    finally:
        block.to("cpu", torch.bfloat16)
    assert y.dtype == torch.bfloat16
    scale = reference.abs().max().item()
    assert (y.cpu().float() - reference).abs().max().item() <= 1.5e-2 * scale

"""The CPU kernel backend (cpu_backend.py over csrc/layers.c) against the torch reference it stands
in for: each layer operation, decode attention through shuffled block tables (GQA, partial blocks,
verification rows beside prefill chunks), every row alone equal to itself in a batch, the
backend's choice, and a quantized model whose steps run no fallback."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from folio.core.engine import generate
from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend
from folio.core.executor.kernels.cpu_backend import CpuKernelBackend, CpuLayerOps
from folio.core.executor.kernels.layer_ops import TORCH_LAYER_OPS, KernelRope
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def backend() -> CpuKernelBackend:
    return CpuKernelBackend(cpu_kernels.library(), BF16, final_norm="final")


def norm(d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(weight=1 + 0.1 * torch.randn(d, generator=g), eps=1e-5)


def bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 rounding step (the two sum their squares in another order)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("x_dtype", [torch.float32, BF16])
def test_add_rms_norm_matches_the_reference_and_each_row_stands_alone(backend, x_dtype):
    ops = backend.layer_ops
    x, residual = torch.randn(37, 576).to(x_dtype), torch.randn(37, 576) * 3
    n = norm(576)
    want_res, want = TORCH_LAYER_OPS.add_rms_norm(x.float(), residual.clone(), n)
    res, got = ops.add_rms_norm(x, residual.clone(), n)
    assert got.dtype == BF16 and torch.equal(res, want_res)  # the residual add is exact in fp32
    bf16_close(got, want)
    for i in (0, 17, 36):
        _, alone = ops.add_rms_norm(x[i:i + 1], residual[i:i + 1].clone(), n)
        assert torch.equal(alone, got[i:i + 1])
    # the final norm keeps the model's dtype (the LM head refines its top logits from it)
    final_ops = CpuLayerOps(cpu_kernels.library(), BF16, final_norm=n)
    _, out = final_ops.add_rms_norm(x, residual.clone(), n)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    plain = final_ops.rms_norm(residual, n)  # a norm alone leaves its input as it was
    torch.testing.assert_close(plain, TORCH_LAYER_OPS.rms_norm(residual, n), rtol=1e-5, atol=1e-5)
    assert final_ops.num_fallbacks == ops.num_fallbacks == 0


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_silu_and_mul_matches_the_reference(backend, dtype):
    gate_up = (torch.randn(9, 2 * 1536) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([-90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0, 3.0])
    got = backend.layer_ops.silu_and_mul(gate_up)
    assert got.dtype == BF16
    bf16_close(got, TORCH_LAYER_OPS.silu_and_mul(gate_up.float()))
    assert torch.equal(backend.layer_ops.silu_and_mul(gate_up[4:5]), got[4:5])


def attn_module(num_heads: int, num_kv_heads: int, head_dim: int):
    return SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           q_size=num_heads * head_dim, kv_size=num_kv_heads * head_dim, kv_rotation=None,
                           kv_scales=(1.0, 1.0))


@pytest.mark.parametrize("qkv_dtype", [torch.float32, BF16])
def test_rope_and_the_kv_write_match_the_reference(backend, qkv_dtype):
    from folio.core.executor.model.layers import rope_cos_sin

    heads, kv_heads, dim, bs = 9, 3, 64, 16
    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, head_dim=dim,
                          hidden_size=heads * dim, num_attention_heads=heads)
    cos, sin = rope_cos_sin(cfg, 512, torch.float32)
    model = SimpleNamespace(rope_cos=cos, rope_sin=sin)
    attn = attn_module(heads, kv_heads, dim)
    n = 11
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim).to(qkv_dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 300, 511, 2, 3, 4, 9])
    slots = torch.tensor([3, 40, 41, -1, 7, 8, 100, 101, 102, 5, 6])  # -1: padding, not written
    meta = AttentionMetadata.build([n], [n], [[0]], slots, bs)
    pools = [tuple(torch.full((8, bs, kv_heads, dim), 7.0) for _ in range(2)) for _ in range(2)]
    q_ref = TORCH_LAYER_OPS.rope_write_kv(qkv.float(), attn, (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)),
                                          *pools[0], meta, TorchAttentionBackend())
    q = backend.layer_ops.rope_write_kv(qkv, attn, KernelRope(model, positions), *pools[1], meta, backend)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    for want, got in zip(pools[0], pools[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(8 * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (pools[1][0].view(-1, kv_heads, dim)[untouched] == 7.0).all()  # padding wrote nothing
    assert backend.layer_ops.num_fallbacks == 0


def pool_and_meta(rng: random.Random, query_lens: list[int], seq_lens: list[int], kv_heads: int, dim: int, bs: int):
    num_blocks = sum((s + bs - 1) // bs for s in seq_lens) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # tables in any order
    tables, at = [], 0
    for s in seq_lens:
        k = (s + bs - 1) // bs
        tables.append(ids[at:at + k])
        at += k
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    return k_cache, v_cache, AttentionMetadata.build(query_lens, seq_lens, tables, None, bs)


@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 16, 8), (6, 2, 48, 32)])
def test_decode_attention_matches_the_torch_backend(backend, heads, kv_heads, dim, bs):
    rng = random.Random(heads * dim + bs)
    # decodes of all lengths (partial last blocks), verification rows (3 and 16 tokens), a
    # prefill chunk (torch's SDPA in both backends) and a one-token prompt
    query_lens = [1, 1, 1, 3, 40, 1, 16, 1]
    seq_lens = [1, 17, 300, 35, 60, 64, 80, 5]
    k_cache, v_cache, meta = pool_and_meta(rng, query_lens, seq_lens, kv_heads, dim, bs)
    q = torch.randn(sum(query_lens), heads, dim)
    want = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, dim**-0.5)
    meta.plan = None
    got = backend.attend(q, k_cache, v_cache, meta, dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each decode row alone gives its bits in the batch
    starts = meta.query_start_loc.tolist()
    for b in (1, 2, 5):
        tables = [meta.block_tables[b, :(seq_lens[b] + bs - 1) // bs].tolist()]
        alone = AttentionMetadata.build([1], [seq_lens[b]], tables, None, bs)
        out = backend.attend(q[starts[b]:starts[b] + 1].contiguous(), k_cache, v_cache, alone, dim**-0.5)
        assert torch.equal(out[0], got[starts[b]])


def test_auto_picks_the_kernels_for_quantized_or_batch_invariant_models(tiny_model_dir):
    def backend_of(**kw):
        return ModelRunner(RuntimeConfig(num_kv_blocks=16, device="cpu", **kw), tiny_model_dir).backend.name

    assert backend_of(quantization="int4") == "cpu"
    assert backend_of(quantization="none") == "torch"  # the fp32 default: SDPA
    assert backend_of(quantization="none", batch_invariant=True) == "cpu"  # every token through the per-row kernels
    assert backend_of(quantization="none", attention_backend="cpu") == "cpu"
    assert backend_of(quantization="int4", attention_backend="torch") == "torch"
    assert backend_of(quantization="int4", kv_cache_dtype="fp8") == "torch"  # the kernels read fp32 pools
    with pytest.raises(ValueError, match="fp32 weights and pool"):
        backend_of(quantization="none", attention_backend="cpu", dtype="bfloat16")


def test_a_quantized_model_runs_every_step_through_the_kernels_and_matches_the_reference(tiny_model_dir):
    runners = {name: ModelRunner(RuntimeConfig(num_kv_blocks=64, device="cpu", block_size=8, quantization="int4",
                                               attention_backend=name), tiny_model_dir) for name in ("cpu", "torch")}
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (1, 5, 30, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {name: generate(r, prompts, greedy, max_num_batched_tokens=20) for name, r in runners.items()}
    assert runners["cpu"].backend.layer_ops.num_fallbacks == 0
    assert outs["cpu"] == outs["torch"]
    # and alone, as in the batch
    assert [generate(runners["cpu"], [p], greedy)[0] for p in prompts] == outs["cpu"]

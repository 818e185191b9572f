"""Images whose placeholders attend each other both ways (Gemma 3, ``AttentionMetadata.image_spans``)
in the torch reference backend and the CPU kernel backend (its short chunks and, batch-invariant,
every token through the C decode rows), against a dense oracle whose mask is transformers' own
rule (``masking_utils``: global layers causal OR same image, sliding layers window AND that):
long chunks holding whole images, a chunk that starts inside an image (a prefix hit reached into
it), a short chunk, two images, windows shorter and longer than an image."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.kernels.attention import TorchAttentionBackend
from tests.executor.test_attention_features import MARCHES, make_step

# (cached tokens, new tokens, image [start, end) runs the chunk reaches)
SPECS = [(0, 40, [(5, 21)]), (10, 30, [(4, 20)]), (3, 14, [(5, 12)]), (0, 50, [(3, 13), (20, 40)]), (45, 1, [])]
WINDOWS = [0, 4, 8, 1000]


def transformers_mask(seq_len: int, spans, window: int) -> torch.Tensor:
    """[seq_len, seq_len] True = attend, from transformers' Gemma 3 mask functions."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function, or_masks,
                                            sliding_window_overlay)
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    token_type_ids = torch.zeros(1, seq_len, dtype=torch.long)
    for s, e in spans:
        token_type_ids[0, s:e] = 1
    rule = or_masks(causal_mask_function, blockwise_overlay(get_block_sequence_ids_for_mask(token_type_ids)))
    if window:
        rule = and_masks(rule, sliding_window_overlay(window))
    q, k = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    return rule(torch.tensor(0), torch.tensor(0), q, k)


def oracle(specs, q, dense, scale, window):
    outs, at = [], 0
    for (cached, new, spans), (k, v) in zip(specs, dense):
        seq_len, heads, kv_heads = cached + new, q.shape[1], k.shape[1]
        k = k.double().repeat_interleave(heads // kv_heads, dim=1)
        v = v.double().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[at:at + new].double(), k) * scale
        s = s.masked_fill(~transformers_mask(seq_len, spans, window)[cached:], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        at += new
    return torch.cat(outs).float()


def step(window: int, seed: int = 0, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    k_cache, v_cache, meta, q, dense, _, _ = make_step([(c, n) for c, n, _ in SPECS], heads, kv_heads, dim,
                                                       seed=seed + window)
    meta.image_spans = {b: spans for b, (_, _, spans) in enumerate(SPECS) if spans}
    return k_cache, v_cache, meta, q, oracle(SPECS, q, dense, dim**-0.5, window), dim**-0.5


@pytest.fixture(scope="module", params=MARCHES)
def cpu_lib(request):
    from folio.core.executor.kernels import cpu_kernels

    try:
        lib = cpu_kernels.library() if request.param == "native" else cpu_kernels.library_for(request.param)
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"no {request.param} build here: {exc}")
    if lib is None:
        pytest.skip("no C compiler here")
    return lib


def backends(lib):
    from folio.core.executor.kernels.cpu_backend import CpuKernelBackend

    yield "torch", TorchAttentionBackend()
    yield "cpu", CpuKernelBackend(lib, torch.float32, final_norm=None)
    yield "cpu batch-invariant", CpuKernelBackend(lib, torch.float32, final_norm=None, batch_invariant=True)


@pytest.mark.parametrize("window", WINDOWS)
def test_image_spans_match_transformers_mask_on_every_path(cpu_lib, window):
    k_cache, v_cache, meta, q, want, scale = step(window)
    for name, backend in backends(cpu_lib):
        meta.plan = None
        got = backend.attend(q, k_cache, v_cache, meta, scale, window=window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("window", WINDOWS)
def test_without_the_spans_the_image_rows_differ(cpu_lib, window):
    """The oracle's span rule matters for every path: causal attention misses it on the image rows."""
    k_cache, v_cache, meta, q, want, scale = step(window)
    meta.image_spans = None
    rows = torch.zeros(len(q), dtype=torch.bool)  # the image rows that see a later placeholder
    at = 0
    for cached, new, spans in SPECS:
        for s, e in spans:
            rows[at + max(s, cached) - cached: at + e - 1 - cached] = True
        at += new
    for name, backend in backends(cpu_lib):
        meta.plan = None
        got = backend.attend(q, k_cache, v_cache, meta, scale, window=window)
        assert not torch.isclose(got, want, rtol=1e-3, atol=1e-3).all(-1).all(-1)[rows].any(), name
        torch.testing.assert_close(got[~rows], want[~rows], rtol=1e-5, atol=1e-5)


def test_a_step_that_ends_inside_an_image_is_refused():
    k_cache, v_cache, meta, q, _, scale = step(0)
    meta.image_spans = {0: [(30, 44)]}  # past the sequence's 40 keys
    with pytest.raises(ValueError, match="ends inside an image"):
        TorchAttentionBackend().attend(q, k_cache, v_cache, meta, scale)

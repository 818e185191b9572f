"""``folio.bench.step.write_random_checkpoint``, the fast random Llama that the 1B-shape step benchmark
and the GPU batch-invariance test load: every tensor the loader needs is there in its shape, the
runner holds what was written, and the draw follows the stated distributions."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from folio.bench.step import MODEL_SHAPES, write_random_checkpoint
from folio.core.engine import generate
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams


def test_a_random_checkpoint_loads_as_written(tmp_path):
    sizes = MODEL_SHAPES["tiny"]
    path = write_random_checkpoint(tmp_path, "cpu", torch.bfloat16, **sizes)
    state = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert state["model.embed_tokens.weight"].shape == (sizes["vocab_size"], sizes["hidden_size"])
    assert state["lm_head.weight"].shape == (sizes["vocab_size"], sizes["hidden_size"])
    assert len([n for n in state if n.startswith("model.layers.")]) == 9 * sizes["num_hidden_layers"]
    q = state["model.layers.1.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - 0.02) < 0.002 and abs(q.mean().item()) < 0.002
    assert abs(state["model.norm.weight"].float().mean().item() - 1.0) < 0.05

    runner = ModelRunner(RuntimeConfig(device="cpu", dtype="bfloat16", num_kv_blocks=16, block_size=16,
                                       attention_backend="torch"), path)
    assert torch.equal(runner.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    tokens = generate(runner, [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(tokens[0]) == 4 and all(0 <= t < sizes["vocab_size"] for t in tokens[0])

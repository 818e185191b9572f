"""Our forward pass against transformers on tiny random models of each supported family."""

from __future__ import annotations

import pytest
import torch

from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.testing.models import write_tiny_model
from tests.executor.toy_driver import generate

FAMILIES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2-bias": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mha": ("llama", {"num_key_value_heads": 4}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    return write_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)


def hf_greedy(model_dir, prompt, max_new_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return hf, out[0, len(prompt) :].tolist()


def test_logits_and_greedy_match_transformers(family_dir):
    prompt = [3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33, 2, 90]
    hf, expected = hf_greedy(family_dir, prompt, 40)
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=32, block_size=8), family_dir)
    # whole-prompt logits through the paged path against the reference forward
    with torch.inference_mode():
        ref_logits = hf(torch.tensor([prompt])).logits[0]
    from folio.core.executor.kernels.attention import AttentionMetadata

    n = len(prompt)
    meta = AttentionMetadata.build([n], [n], [[5, 2]], torch.tensor([5 * 8 + i if i < 8 else 2 * 8 + i - 8 for i in range(n)]), 8)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), torch.arange(n), runner.pool.kv_caches, meta, runner.backend)
        ours = runner.model.compute_logits(hidden)
    torch.testing.assert_close(ours, ref_logits, rtol=1e-4, atol=1e-4)
    got = generate(runner, [prompt], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert got == expected


def test_unsupported_family_is_a_clear_error(tmp_path):
    from folio.core.executor.model.registry import model_spec

    class Cfg:
        model_type = "gpt2"

    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        model_spec(Cfg())

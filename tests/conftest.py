"""Shared fixtures: tiny random-weight models written to disk, and the real default model."""

from __future__ import annotations

import pytest
import torch


def write_tiny_model(path, model_type: str = "llama", **overrides) -> str:
    """A random-weight Llama-family checkpoint in ``path`` (config.json + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the init: logits far from uniform, paths differ
        for name, p in model.named_parameters():
            if name.endswith("bias") or p.dim() > 1:
                p.normal_(0.0, 0.2)
            else:  # norm weights
                p.normal_(1.0, 0.1)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The packaged SmolLM2-135M-Instruct, converted once into the cache folder."""
    from folio.core.models import prepare_default_model

    return str(prepare_default_model(quiet=True))


@pytest.fixture(autouse=True)
def one_torch_thread_for_tiny_models(request):
    """Tests without the real model run tiny ones, whose GEMMs are far too small to share between
    threads: with two threads on two busy cores each step waited on the other thread, twenty
    times slower than one thread in a measured run. Tests of the real model keep the default."""
    if "smollm_dir" in request.fixturenames:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

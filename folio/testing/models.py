"""Tiny random-weight checkpoints written to disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def write_tiny_model(path, model_type: str = "llama", **overrides) -> str:
    """A random-weight checkpoint in ``path`` (config.json + safetensors) of any ``model_type``
    transformers knows (its config class's defaults, then these sizes, then ``overrides``)."""
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


def write_tiny_chat_model(folder, tokenizer_dir, max_position_embeddings: int = 256) -> str:
    """A tiny random Llama with a real tokenizer (SmolLM2's), so that the tokenizer service runs."""
    write_tiny_model(folder, vocab_size=49152, max_position_embeddings=max_position_embeddings)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, Path(folder) / f.name)
    return str(folder)

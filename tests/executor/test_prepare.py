"""The default model is prepared once from the packaged GGUF and reused; GGUF loads directly too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from folio.core.executor.model.loader import load_model
from folio.core import model_files


@pytest.mark.slow
def test_prepared_folder_is_complete_and_reused(smollm_dir):
    folder = Path(smollm_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).exists(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert model_files.prepare_default_model(quiet=True) == folder  # second call: nothing converted
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert model_files.resolve_model("SmolLM2-135M-Instruct") == folder


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'SmolLM2-135M-Instruct' nor an existing path"):
        model_files.resolve_model(str(tmp_path / "nope"))


@pytest.mark.slow
def test_gguf_file_loads_to_the_same_weights(smollm_dir):
    cpu = torch.device("cpu")
    from_folder = load_model(smollm_dir, torch.float32, cpu).state_dict()
    from_gguf = load_model(model_files.packaged_gguf(), torch.float32, cpu).state_dict()
    assert from_folder.keys() == from_gguf.keys()
    for name, tensor in from_folder.items():
        assert torch.equal(tensor, from_gguf[name]), name


def test_bf16_and_fp16_loading(tiny_model_dir):
    for dtype in (torch.bfloat16, torch.float16):
        model = load_model(tiny_model_dir, dtype, torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert model.rope_cos.dtype == dtype

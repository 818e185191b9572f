"""A checkpoint's ``transformers`` config, from a model folder or a .gguf file (a leaf module: the
loader and the sharded loader both read it)."""

from __future__ import annotations

from pathlib import Path


def load_hf_config(path: Path):
    from transformers import AutoConfig

    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)

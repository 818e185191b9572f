"""A checkpoint's ``transformers`` config, from a model folder or a .gguf file (a leaf module: the
loader and the sharded loader both read it)."""

from __future__ import annotations

from pathlib import Path


def load_hf_config(path: Path):
    """A .gguf file's config comes from its metadata through folio's own reader (transformers'
    reads the whole file through gguf-py: seconds, and tens of seconds for a large vocabulary)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from folio.core.gguf_file import read_gguf_config

        return read_gguf_config(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)

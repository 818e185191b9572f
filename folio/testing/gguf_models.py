"""GGUF files written by llama.cpp's own tools from random-weight Hugging Face checkpoints.

``convert_tiny_model(folder)`` gives a tiny checkpoint (``folio.testing.models.write_tiny_model``)
the tokenizer llama.cpp's converter wants and runs ``convert_hf_to_gguf.py`` on it: the GGUF the
readers are checked against. Most families take a SentencePiece ``tokenizer.model`` of under 128
pieces (made here, no download); the converter reads Qwen's MoE families only as a byte-level BPE
whose pre-tokenizer it recognises, so those get SmolLM2's tokenizer and need a vocabulary of at
least ``SMOLLM_VOCAB`` tokens.
"""

from __future__ import annotations

import io
import random
import shutil
import sys
from pathlib import Path

from folio.testing.llamacpp import convert_hf_to_gguf

SMOLLM_VOCAB = 49152
# the model types whose converter classes read no tokenizer.model (TextModel's byte-level BPE only)
BPE_ONLY = frozenset({"qwen2_moe", "qwen3_moe"})
_WORDS = ("the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "hello", "world", "quick", "fox")


def write_tiny_tokenizer(folder, max_pieces: int = 100) -> Path:
    """A SentencePiece BPE ``tokenizer.model`` of at most ``max_pieces`` pieces (ids 0-2: unk, bos,
    eos), trained in memory on a fixed text."""
    import sentencepiece as spm

    rng = random.Random(0)
    text = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=max_pieces,
                                   model_type="bpe", hard_vocab_limit=False, minloglevel=2)
    path = Path(folder) / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def smollm_tokenizer_files(folder) -> Path:
    """SmolLM2's tokenizer files copied into ``folder``: from the prepared default model when there
    is one, else read from the packaged GGUF."""
    from folio.core.models import default_model_dir, is_prepared, packaged_gguf

    folder = Path(folder)
    source = default_model_dir()
    if is_prepared(source):
        for f in source.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, folder / f.name)
        return folder
    from transformers import AutoTokenizer

    gguf = packaged_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def convert_tiny_model(folder, out=None, outtype: str = "f32", log=None) -> Path:
    """``folder`` (a checkpoint without a tokenizer) converted by llama.cpp's ``convert_hf_to_gguf.py``
    into ``out`` (default: ``<folder>.gguf`` beside it), after adding the tokenizer it needs."""
    import json

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] in BPE_ONLY:
        if config["vocab_size"] < SMOLLM_VOCAB:
            raise ValueError(f"{config['model_type']} converts with SmolLM2's tokenizer: vocab_size >= {SMOLLM_VOCAB}")
        smollm_tokenizer_files(folder)
    else:
        write_tiny_tokenizer(folder, max_pieces=min(100, config["vocab_size"]))
    out = Path(out) if out is not None else folder.with_suffix(".gguf")
    return convert_hf_to_gguf(folder, out, outtype=outtype, log=log)


if __name__ == "__main__":
    print(convert_tiny_model(sys.argv[1], *(sys.argv[2:3])))

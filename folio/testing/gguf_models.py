"""GGUF files written by llama.cpp's own tools from random-weight Hugging Face checkpoints.

``convert_tiny_models({folder: out})`` gives tiny checkpoints (``write_tiny_model``'s) the
tokenizer llama.cpp's converter wants and runs ``convert_hf_to_gguf.py`` on them, all in one
process: the GGUFs the readers are checked against. Most families take a SentencePiece
``tokenizer.model`` of under 128 pieces (made here, no download); the converter reads Qwen's MoE
families only as a byte-level BPE whose pre-tokenizer it recognises, so those get SmolLM2's
tokenizer and need a vocabulary of at least ``SMOLLM_VOCAB`` tokens.

More in docs/modules.md (folio/testing/gguf_models.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from folio.shared.config import cache_dir
from folio.testing.llamacpp import LLAMA_CPP_PYTHON, convert_hf_to_gguf, convert_many, find_llama_quantize, quantize

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
    from folio.core.model_files import default_model_dir, is_prepared, packaged_gguf

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


def add_tokenizer(folder) -> Path:
    """The tokenizer llama.cpp's converter wants for the checkpoint in ``folder``, written beside it."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] in BPE_ONLY:
        if config["vocab_size"] < SMOLLM_VOCAB:
            raise ValueError(f"{config['model_type']} converts with SmolLM2's tokenizer: vocab_size >= {SMOLLM_VOCAB}")
        smollm_tokenizer_files(folder)
    else:
        write_tiny_tokenizer(folder, max_pieces=min(100, config["vocab_size"]))
    return folder


def convert_tiny_models(outputs: dict, outtype: str = "f32", log=None) -> dict[str, str]:
    """Each checkpoint folder (without a tokenizer) -> its GGUF path in ``outputs``, converted by
    llama.cpp's ``convert_hf_to_gguf.py`` in one process after adding the tokenizer it needs;
    returns {out: the converter's traceback} for those that failed."""
    for folder in outputs:
        add_tokenizer(folder)
    return convert_many([(folder, out, outtype) for folder, out in outputs.items()], log)


def convert_tiny_model(folder, out=None, outtype: str = "f32", log=None) -> Path:
    """``convert_tiny_models`` for one folder (``out`` default: ``<folder>.gguf`` beside it)."""
    out = Path(out) if out is not None else Path(folder).with_suffix(".gguf")
    add_tokenizer(folder)
    return convert_hf_to_gguf(folder, out, outtype=outtype, log=log)


# Llama-3.2-1B's config.json, its dimensions and RoPE; its tokenizer's special ids are SmolLM2's
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
# Llama-3.2-3B's config.json the same way (3.21B parameters, tied head)
LLAMA_3B = dict(LLAMA_1B, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128)
# the same writer's smallest useful shape (rows a multiple of 32 for Q4 blocks; padded vocabulary)
TINY_LLAMA = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=SMOLLM_VOCAB + 64)


def _layer_tensors(shape: dict, layer: int, generator) -> dict:
    import torch

    hidden, inter, dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    prefix = f"model.layers.{layer}."
    sizes = {"self_attn.q_proj": (heads * dim, hidden), "self_attn.k_proj": (kv * dim, hidden),
             "self_attn.v_proj": (kv * dim, hidden), "self_attn.o_proj": (hidden, heads * dim),
             "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    out = {f"{prefix}{name}.weight": _normal(size, generator) for name, size in sizes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{prefix}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return out


def _normal(size, generator, std: float = 0.02):
    import torch

    return (torch.randn(size, generator=generator) * std).to(torch.bfloat16)


def write_llama_checkpoint(folder, shape: dict = LLAMA_1B, seed: int = 0) -> Path:
    """A random-weight BF16 Llama of ``shape`` with SmolLM2's tokenizer, written a layer per
    safetensors shard (one layer in memory at a time)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, dtype="bfloat16",
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    smollm_tokenizer_files(folder)
    generator = torch.Generator().manual_seed(seed)
    n = shape["num_hidden_layers"] + 1
    weight_map, total = {}, 0
    for shard in range(n):
        if shard == 0:
            tensors = {"model.embed_tokens.weight": _normal((shape["vocab_size"], shape["hidden_size"]), generator),
                       "model.norm.weight": torch.ones(shape["hidden_size"], dtype=torch.bfloat16)}
        else:
            tensors = _layer_tensors(shape, shard - 1, generator)
        name = f"model-{shard + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def write_llama_gguf(path, shape: dict = LLAMA_1B, qtype: str = "Q4_1", seed: int = 0, log=sys.stderr) -> Path:
    """``path``: a random-weight Llama of ``shape`` converted by llama.cpp to BF16 and, unless
    ``qtype`` is BF16, quantized by its ``llama-quantize`` (``python -m folio.testing.llamacpp``
    builds it)."""
    path = Path(path)
    binary = _quantizer(qtype)
    with tempfile.TemporaryDirectory(prefix="folio-llama-shape-", dir=path.parent) as tmp:
        folder = write_llama_checkpoint(Path(tmp) / "hf", shape, seed)
        bf16 = convert_hf_to_gguf(folder, Path(tmp) / "bf16.gguf", outtype="bf16", log=log)
        shutil.rmtree(folder)
        partial = path.with_name(path.name + ".partial")
        if binary is None:
            shutil.move(bf16, partial)
        else:
            quantize(binary, bf16, partial, qtype, log=log)
        partial.replace(path)
    return path


def _quantizer(qtype: str) -> str | None:
    """llama-quantize's path for ``qtype`` (None for BF16, which needs none); raises when not built."""
    if qtype.upper() == "BF16":
        return None
    binary = find_llama_quantize()
    if binary is None:
        raise FileNotFoundError("llama-quantize is not built: python -m folio.testing.llamacpp builds it")
    return binary


def llama_shape_key(shape: dict, qtype: str, seed: int = 0) -> str:
    blob = json.dumps({"shape": shape, "seed": seed, "llama.cpp": LLAMA_CPP_PYTHON}, sort_keys=True)
    return f"{hashlib.sha256(blob.encode()).hexdigest()[:12]}-{qtype.upper()}"


def _smollm2_key(qtype: str) -> str:
    """What the SmolLM2 files depend on: the packaged GGUF they come from and the llama.cpp pin."""
    from folio.core.model_files import packaged_gguf

    gguf = packaged_gguf()
    blob = json.dumps({"smollm2": gguf.name, "size": gguf.stat().st_size, "llama.cpp": LLAMA_CPP_PYTHON})
    return f"{hashlib.sha256(blob.encode()).hexdigest()[:12]}-{qtype.upper()}"


BENCH_SHAPES = ("smollm2", "1b", "3b")
LLAMA_SHAPES = {"1b": LLAMA_1B, "3b": LLAMA_3B}


def bench_gguf_path(shape: str, qtype: str) -> Path:
    """Where ``bench_gguf(shape, qtype)`` keeps its file (the packaged file for SmolLM2's Q4_1)."""
    qtype = qtype.upper()
    if shape == "smollm2":
        from folio.core.model_files import packaged_gguf

        if qtype == "Q4_1":
            return packaged_gguf()
        return cache_dir() / "gguf" / f"smollm2-135m-{_smollm2_key(qtype)}.gguf"
    if shape not in LLAMA_SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(BENCH_SHAPES)}")
    return cache_dir() / "gguf" / f"llama-3.2-{shape}-shape-{llama_shape_key(LLAMA_SHAPES[shape], qtype)}.gguf"


def bench_gguf(shape: str, qtype: str, log=sys.stderr) -> Path:
    """The benchmark file of ``shape`` in ``qtype`` (``BF16`` or a ``llama-quantize`` type), made once:
    the BF16 file first (minutes for the 3B shape; its checkpoint, about 6.4 GB, is dropped once
    converted), then the type quantized from it."""
    target = bench_gguf_path(shape, qtype)
    if target.is_file():
        return target
    binary = _quantizer(qtype)
    source = None if binary is None else bench_gguf(shape, "BF16", log)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        partial = target.with_name(target.name + ".partial")
        if source is not None:
            quantize(binary, source, partial, qtype, log=log)
        elif shape == "smollm2":
            with tempfile.TemporaryDirectory(prefix="folio-smollm2-", dir=target.parent) as tmp:
                convert_hf_to_gguf(smollm2_checkpoint(Path(tmp)), partial, outtype="bf16", log=log)
        else:
            with tempfile.TemporaryDirectory(prefix="folio-llama-shape-", dir=target.parent) as tmp:
                folder = write_llama_checkpoint(Path(tmp) / "hf", LLAMA_SHAPES[shape])
                convert_hf_to_gguf(folder, partial, outtype="bf16", log=log)
        partial.replace(target)
    return target


def smollm2_checkpoint(folder: Path) -> Path:
    """The prepared SmolLM2 folder as llama.cpp's converter reads it: its files linked into
    ``folder``, its config naming the architecture (a config rebuilt from a GGUF names none)."""
    from folio.core.model_files import prepare_default_model

    source = prepare_default_model(quiet=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def llama_1b_gguf(qtype: str = "Q4_1", log=sys.stderr) -> Path:
    """The 1B-shape GGUF in ``qtype`` (``bench_gguf("1b", qtype)``)."""
    return bench_gguf("1b", qtype, log)


if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in BENCH_SHAPES:
        print(bench_gguf(sys.argv[1], *(sys.argv[2:3] or ["Q4_1"])))
    else:
        print(convert_tiny_model(sys.argv[1], *(sys.argv[2:3])))

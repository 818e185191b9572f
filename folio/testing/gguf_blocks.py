"""Random GGUF blocks of any type folio's kernels read, and small llama GGUFs made of them.

``random_blocks(type, n, k, rng)`` draws every quant bit and sub-scale, with small normal fp16
scales (random bytes there could be inf or NaN). ``write_llama_gguf(path, types)`` writes a llama
whose tensors are such blocks, tensor kind by kind (``{"attn_q": "Q4_K", "ffn_down": "Q6_K",
"token_embd": "Q6_K", ...}``; the rest F32), with the metadata folio reads: the weights are the
blocks' values, so the file loaded dense (gguf-py's dequantization) is the oracle of the file
served in its own types. Speed does not depend on the values either.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# where each GGUF block keeps its fp16 scales
FP16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
           "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}
SMALL = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=320)


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """[n, bytes a row] uint8: n rows of k inputs in GGUF type ``name``."""
    import gguf

    unit, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    if k % unit:
        raise ValueError(f"{name} rows are whole units of {unit}, not {k}")
    raw = rng.integers(0, 256, size=(n, k // unit, size), dtype=np.uint8)
    for off in FP16_AT[name]:
        d = (rng.standard_normal((n, k // unit)) * scale).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n, k // unit, 2)
    return raw.reshape(n, -1)


def write_llama_gguf(path: str | Path, types: dict[str, str], shape: dict | None = None, seed: int = 0,
                     tied: bool = True) -> Path:
    """A llama GGUF of ``shape`` (``SMALL`` by default) whose tensor kinds named in ``types`` hold
    random blocks of those types (the others random F32)."""
    import gguf

    s = {**SMALL, **(shape or {})}
    rng = np.random.default_rng(seed)
    hd = s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(s["layers"])
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    def tensor(name: str, kind: str, n: int, k: int) -> None:
        if kind in types:
            qtype = gguf.GGMLQuantizationType[types[kind]]
            w.add_tensor(name, random_blocks(types[kind], n, k, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, (rng.standard_normal((n, k)) * 0.05).astype(np.float32))

    tensor("token_embd.weight", "token_embd", s["vocab"], s["hidden"])
    if not tied:
        tensor("output.weight", "output", s["vocab"], s["hidden"])
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(s["hidden"])).astype(np.float32))
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    for i in range(s["layers"]):
        b = f"blk.{i}."
        for kind, n, k in (("attn_q", q, s["hidden"]), ("attn_k", kv, s["hidden"]), ("attn_v", kv, s["hidden"]),
                           ("attn_output", s["hidden"], q), ("ffn_gate", s["intermediate"], s["hidden"]),
                           ("ffn_up", s["intermediate"], s["hidden"]), ("ffn_down", s["hidden"], s["intermediate"])):
            tensor(f"{b}{kind}.weight", kind, n, k)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"{b}{norm}.weight", (1 + 0.1 * rng.standard_normal(s["hidden"])).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


Q4_K_M = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}  # llama.cpp's mix, roughly


def all_of(name: str) -> dict[str, str]:
    """Every projection and the embedding table in one type."""
    kinds = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return {k: name for k in kinds}

"""Quality for ``folio bench cpu-vs-llamacpp``: each engine's KL divergence from the BF16 model.

llama.cpp's log-probability files (``read_dump``, ``encode_log_probs``), the KL divergence between
two of them (``kld``), the peers' files (``perplexity_dump``) and folio's (``write_folio_dump``), and
the quality gate's text (``gate_text``).

More in docs/modules.md (folio/bench/peer_quality.py).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"_logits_"
CUTOFF = -16.0  # llama.cpp leaves out reference probabilities below e^-16


@dataclass
class Dump:
    """A ``--kl-divergence-base`` file, mapped: ``records[i]`` is the i-th scored position's
    ``[scale, offset]`` header (two float32 in four uint16) and its ``n_vocab`` encoded log-probs."""

    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # int32 [n_chunk * n_ctx]
    records: np.ndarray  # uint16 [n_chunk * (n_ctx - 1 - n_ctx // 2), nv]

    @property
    def first(self) -> int:
        return self.n_ctx // 2  # llama-perplexity scores the second half of each chunk

    def log_probs(self, rows: slice) -> np.ndarray:
        """Decoded log-probabilities ``[rows, n_vocab]`` (float32)."""
        block = self.records[rows]
        header = np.ascontiguousarray(block[:, :4]).view(np.float32)  # [rows, 2]: scale, offset
        return block[:, 4:4 + self.n_vocab].astype(np.float32) * header[:, :1] + header[:, 1:2]


def record_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def read_dump(path: str | Path) -> Dump:
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise ValueError(f"{path} is not a llama.cpp log-probability file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32).tolist()
    offset = 8 + 12
    tokens = np.memmap(path, dtype=np.int32, mode="r", offset=offset, shape=(n_ctx * n_chunk,))
    offset += tokens.nbytes
    rows = n_chunk * (n_ctx - 1 - n_ctx // 2)
    records = np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=(rows, record_width(n_vocab)))
    return Dump(n_ctx, n_vocab, n_chunk, tokens, records)


def encode_log_probs(logits: np.ndarray) -> np.ndarray:
    """llama.cpp's encoding of each row of ``logits`` ``[rows, n_vocab]``: log-probs within 16 of the
    largest, in 65,535 steps, above a per-row float scale and offset (``uint16 [rows, nv]``)."""
    logits = logits.astype(np.float32)
    rows, n_vocab = logits.shape
    top = logits.max(1, keepdims=True)
    low = np.maximum(logits.min(1, keepdims=True), top - 16)
    log_sum_exp = np.log(np.exp(logits - top).sum(1, keepdims=True, dtype=np.float64)).astype(np.float32)
    scale = (top - low) / 65535.0
    out = np.zeros((rows, record_width(n_vocab)), dtype=np.uint16)
    header = np.concatenate([scale, low - top - log_sum_exp], axis=1).astype(np.float32)
    out[:, :4] = header.view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.where(logits > low, np.rint((logits - low) / np.where(scale > 0, scale, 1)), 0)
    out[:, 4:4 + n_vocab] = np.minimum(steps, 65535).astype(np.uint16)
    return out


def kld(reference: Dump, dump: Dump, block: int = 64) -> dict:
    """Mean KL(P_reference || P_dump) over the scored positions, the top-1 agreement and the
    positions counted; the same sum as ``llama-perplexity --kl-divergence``."""
    if (reference.n_ctx, reference.n_vocab, reference.n_chunk) != (dump.n_ctx, dump.n_vocab, dump.n_chunk):
        raise ValueError("the two files cover different chunks or vocabularies")
    if not np.array_equal(reference.tokens, dump.tokens):
        raise ValueError("the two files scored different tokens")
    total = agree = 0.0
    rows = len(reference.records)
    for start in range(0, rows, block):
        rows_slice = slice(start, min(start + block, rows))
        ref, q = reference.log_probs(rows_slice), dump.log_probs(rows_slice)
        terms = np.where(ref > CUTOFF, np.exp(ref) * (ref - q), 0.0)
        total += float(terms.sum(dtype=np.float64))
        agree += float((ref.argmax(1) == q.argmax(1)).sum())
    return {"kld": total / rows, "top1": agree / rows, "positions": rows}


# --------------------------------------------------------------------------- the peers' dumps


def perplexity_dump(binary: str, model: str | Path, text: Path, out: Path, n_ctx: int, threads: int,
                    extra: tuple[str, ...] = (), log: Path | None = None) -> Path:
    """``llama-perplexity --kl-divergence-base OUT`` of a peer on ``model`` over ``text``."""
    command = [binary, "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads),
               "--kl-divergence-base", str(out), *extra]
    with open(log or out.with_suffix(".log"), "w") as f:
        result = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=out.parent)  # its llama.log too
    if result.returncode != 0 or not out.is_file():
        text_log = Path(log or out.with_suffix(".log")).read_text()[-3000:]
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{text_log}")
    return out


# --------------------------------------------------------------------------- folio's dumps


def gate_text(out: Path, num_tokens: int) -> Path:
    """The quality gate's text: the seeded samples ``folio.bench.eval_quant`` scores SmolLM2 on, at
    least ``num_tokens`` tokens, decoded and joined by blank lines (made once, then cached there)."""
    from transformers import AutoTokenizer

    from folio.bench.eval_quant import reference_text
    from folio.core.model_files import resolve_model
    from folio.shared.config import DEFAULT_MODEL_NAME

    path = resolve_model(DEFAULT_MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(path)
    seqs = reference_text(None, tokenizer, path, num_tokens, 0)
    out.write_text("\n\n".join(tokenizer.decode(s) for s in seqs))
    return out


def _bos(model: Path) -> int | None:
    """The BOS id llama.cpp puts first in each chunk, or None when the file says not to add one."""
    import gguf

    fields = gguf.GGUFReader(str(model)).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    if add is None or not add.contents():
        return None
    return int(fields["tokenizer.ggml.bos_token_id"].contents())


def write_folio_dump(model: str | Path, reference: str | Path, out: str | Path) -> Path:
    """folio's log-probabilities on ``model`` over ``reference``'s chunks, in its format: the model
    loaded as ``folio serve`` loads it (``--quantization auto``, fp32 activations on the CPU) and
    run on the backend a server would pick (``eval_quant.log_probs``)."""
    import torch

    from folio.bench.eval_quant import log_probs
    from folio.core.executor.model.loader import load_model

    ref = read_dump(reference)
    model_path = Path(model)
    loaded = load_model(model_path, torch.float32, torch.device("cpu"), "auto")
    bos = _bos(model_path)
    with open(out, "wb") as f:
        f.write(MAGIC + np.array([ref.n_ctx, ref.n_vocab, ref.n_chunk], dtype=np.int32).tobytes())
        f.write(np.ascontiguousarray(ref.tokens).tobytes())
        for chunk in range(ref.n_chunk):
            seq = ref.tokens[chunk * ref.n_ctx:(chunk + 1) * ref.n_ctx].tolist()
            if bos is not None:
                seq[0] = bos
            lp = log_probs(loaded, seq)[ref.first:ref.n_ctx - 1]  # the logits at position j predict j + 1
            f.write(encode_log_probs(lp[:, :ref.n_vocab].numpy()).tobytes())
    return Path(out)


def folio_dump(model: str | Path, reference: Path, out: Path, env: dict, log: Path) -> Path:
    """``write_folio_dump`` in a child process (its memory goes with it)."""
    code = ("import sys\nfrom folio.bench.peer_quality import write_folio_dump\n"
            "write_folio_dump(sys.argv[1], sys.argv[2], sys.argv[3])\n")
    with open(log, "w") as f:
        result = subprocess.run([sys.executable, "-c", code, str(model), str(reference), str(out)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"folio's log-probabilities on {model} failed:\n{log.read_text()[-3000:]}")
    return out


def write_gate_text(out: Path, num_tokens: int, env: dict) -> Path:
    """``gate_text`` in a child process (it loads SmolLM2 to sample the text the first time)."""
    code = "import sys\nfrom folio.bench.peer_quality import gate_text\ngate_text(__import__('pathlib').Path(" \
           "sys.argv[1]), int(sys.argv[2]))\n"
    result = subprocess.run([sys.executable, "-c", code, str(out), str(num_tokens)], env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the quality gate's text failed:\n{result.stderr[-3000:]}")
    return out

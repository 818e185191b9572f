"""Pooling: a request's answer as one vector computed from its prompt, instead of tokens.

Decoder embedding models (Qwen3-Embedding's shape) and any generative model asked for embeddings
(``--task embed``) pool the last token: the final hidden state (after the final norm) at the last
prompt position carries the whole prompt through causal attention. A yes/no reranker
(Qwen3-Reranker's shape) is scored by its LM head's logits of a few tokens at that same position.
The runner gathers those last positions of a step's pooling requests into one tensor; this module
turns them into vectors, which leave the executor as little-endian float32 bytes (never a tensor).
An encoder-only model (BERT) pools each input's whole span instead (``encoder_pooled``: mean or
CLS, as its checkpoint says), every input whole in its step.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import torch

from folio.shared.sampling import PoolingParams


def pool_vectors(last: torch.Tensor, params: list[PoolingParams], req_ids: list[str],
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, bytes]:
    """``last``: [num_requests, hidden] final hidden states at each request's last prompt token.
    Embeddings are truncated to ``dimensions`` first and normalised after (Matryoshka: the leading
    values, renormalised); scores are the logits of ``token_ids``, in fp32."""
    out: dict[str, bytes] = {}
    scored = [i for i, p in enumerate(params) if p.kind == "score"]
    if scored:
        idx = torch.as_tensor(scored, device=last.device)
        logits = compute_logits(last.index_select(0, idx)).float()
        for row, i in enumerate(scored):
            ids = torch.as_tensor(params[i].token_ids, device=logits.device)
            out[req_ids[i]] = _le_bytes(logits[row].index_select(0, ids))
    for i, p in enumerate(params):
        if p.kind != "embed":
            continue
        vector = last[i].float()
        if p.dimensions is not None:
            vector = vector[: p.dimensions]
        if p.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        out[req_ids[i]] = _le_bytes(vector)
    return out


def _le_bytes(vector: torch.Tensor) -> bytes:
    return vector.detach().cpu().numpy().astype("<f4").tobytes()


def encoder_pooled(model, hidden: torch.Tensor, last_idx: np.ndarray, counts: np.ndarray,
                   params: list[PoolingParams]) -> tuple[torch.Tensor, list[PoolingParams]]:
    """An encoder-only model's pooled inputs ``[num_inputs, hidden]`` (each input's tokens end at
    ``last_idx`` and number ``counts``: the whole input) and their params, normalised only where
    the checkpoint normalises too (its sentence-transformers ``Normalize`` module)."""
    last = torch.as_tensor(last_idx, device=hidden.device)
    first = last - torch.as_tensor(counts, device=hidden.device) + 1
    if not model.normalize:
        params = [msgspec.structs.replace(p, normalize=False) if p.normalize else p for p in params]
    return model.pool_rows(hidden, first, last), params

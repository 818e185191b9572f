"""Presence, frequency and repetition penalties as per-row state, kept incrementally.

The runner's persistent batch gives each request a row; ``PenaltyState`` keeps, per row:
- ``bias`` [rows, vocab]: ``-(frequency * count + presence)`` on every token the request has
  generated, 0 elsewhere (the additive part of the penalties, applied with one add);
- ``counts`` [rows, vocab] int32, behind the bias;
- ``rep`` [rows, vocab] fp32: the repetition penalty on prompt and output tokens, 1 elsewhere (a
  float table rather than a mask: ``sampler.process_logits`` applies it as ``min(l / rep, l * rep)``,
  with no boolean select, which torch's CPU kernels run several times slower than arithmetic).
The bias entry of a token the request has seen (prompt or output) always has a bit set: the
penalty, or -0.0 where it is zero; a token never seen holds +0.0. That makes the bias table alone
tell which tokens the repetition penalty applies to, so the CPU kernel reads one [vocab] row per
request instead of two (at batch 256 and vocabulary 512 the two were 1 MB a step, pushing the rest
of the step's data out of the core's cache); ``rep`` is kept for the torch path.
A request that joins writes its row once from its history; each step adds the sampled tokens with
a few index operations over the sampled rows, so nothing is rebuilt from whole outputs. The tensors
live on the executor's device and are allocated on first use (a batch that never asks for a
penalty pays nothing). ``tensors_from_rows`` builds the same [n, vocab] tensors from token lists,
for callers without persistent rows (verification, drafts, tests). The sampler applies both kinds
in ``sampler.process_logits``.
"""

from __future__ import annotations

import numpy as np
import torch

from folio.core.executor.kernels import cpu_kernels


def has_penalties(params) -> bool:
    """Whether the token history changes this request's distribution (only penalties read it)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _row_tensors(vocab: int, params, prompt_ids, output_ids, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts, bias, rep) of one request, each [vocab], from its token lists."""
    counts = torch.zeros(vocab, dtype=torch.int32, device=device)
    if len(output_ids):
        ids = torch.as_tensor(output_ids, dtype=torch.long, device=device)
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    generated = counts > 0
    seen = generated.clone()
    if len(prompt_ids):
        seen[torch.as_tensor(prompt_ids, dtype=torch.long, device=device)] = True
    frequency, presence = neutral_zero(params.frequency_penalty), neutral_zero(params.presence_penalty)
    bias = -(frequency * counts.float() + presence * generated.float())  # -0.0 where nothing was generated
    bias = torch.where(seen, bias, torch.zeros_like(bias))  # +0.0 where the token was never seen
    rep = torch.ones(vocab, dtype=torch.float32, device=device)
    if params.repetition_penalty != 1.0:
        rep[seen] = params.repetition_penalty
    return counts, bias, rep


def neutral_zero(x: float) -> float:
    """x, with a -0.0 made +0.0: a bias entry of -(0 * count + 0) must come out -0.0 (seen)."""
    return x + 0.0


def tensors_from_rows(rows, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(bias [n, vocab], rep [n, vocab] or None when no row has a repetition penalty)."""
    parts = [_row_tensors(vocab, r.params, r.prompt_token_ids, r.output_token_ids, device) for r in rows]
    bias = torch.stack([b for _, b, _ in parts])
    want_rep = any(r.params.repetition_penalty != 1.0 for r in rows)
    return bias, (torch.stack([s for _, _, s in parts]) if want_rep else None)


class PenaltyState:
    """Penalty tensors for ``num_rows`` persistent rows (see the module docstring)."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, device
        self.bias: torch.Tensor | None = None  # [num_rows, vocab] fp32
        self.counts: torch.Tensor | None = None  # [num_rows, vocab] int32
        self.rep: torch.Tensor | None = None  # [num_rows, vocab] fp32

    @property
    def allocated(self) -> bool:
        return self.bias is not None

    def _allocate(self) -> None:
        shape = (self.num_rows, self.vocab_size)
        self.bias = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.rep = torch.ones(shape, dtype=torch.float32, device=self.device)

    def grow(self, num_rows: int) -> None:
        if num_rows <= self.num_rows:
            return
        extra = num_rows - self.num_rows
        self.num_rows = num_rows
        if self.allocated:
            pad = lambda t, v=0: torch.cat([t, torch.full((extra, self.vocab_size), v, dtype=t.dtype, device=t.device)])
            self.bias, self.counts, self.rep = pad(self.bias), pad(self.counts), pad(self.rep, 1)

    def set_row(self, row: int, params, prompt_ids, output_ids) -> None:
        """A request joins row ``row`` (new, resumed or forked): its penalties from its history."""
        if not has_penalties(params):
            if self.allocated:  # the row may hold a previous request's state; it must read as none
                self.bias[row].zero_()
                self.counts[row].zero_()
                self.rep[row].fill_(1.0)
            return
        if not self.allocated:
            self._allocate()
        counts, bias, rep = _row_tensors(self.vocab_size, params, prompt_ids, output_ids, self.device)
        self.counts[row], self.bias[row], self.rep[row] = counts, bias, rep

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor, frequency: torch.Tensor,
               presence: torch.Tensor, repetition: torch.Tensor) -> None:
        """Tokens just generated: ``rows``, ``token_ids`` and the rows' ``frequency``, ``presence``
        and ``repetition`` are [n] (a row may repeat, as a verification appends several tokens).
        Rows without penalties get a zero bias and a repetition of 1."""
        if not self.allocated or rows.numel() == 0:
            return
        if self.device.type == "cpu" and cpu_kernels.library() is not None:  # one call, not five ops
            cpu_kernels.record_penalties(rows, token_ids, frequency, presence, repetition, self.counts, self.bias,
                                         self.rep)
            return
        index = (rows, token_ids)
        self.counts.index_put_(index, torch.ones_like(token_ids, dtype=torch.int32), accumulate=True)
        count = self.counts[index].float()
        self.bias[index] = -(frequency * count + presence)
        self.rep[index] = repetition

    def gather(self, rows: torch.Tensor, want_rep: bool, host_rows: np.ndarray | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bias, rep) of the step's sampling rows, [n, vocab] each: views of the tables when
        ``host_rows`` (the same rows on the host) is a run of consecutive rows, else copies."""
        if not self.allocated:
            self._allocate()
        n = len(rows)
        if host_rows is not None and n and host_rows[-1] - host_rows[0] == n - 1 and (np.diff(host_rows) == 1).all():
            start = int(host_rows[0])
            return self.bias[start : start + n], (self.rep[start : start + n] if want_rep else None)
        return self.bias.index_select(0, rows), (self.rep.index_select(0, rows) if want_rep else None)

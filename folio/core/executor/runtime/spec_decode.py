"""Proposers for speculative decoding: what the target model verifies next step.

Decode reads every weight to produce one token per sequence; a proposer guesses the next ``k``
tokens cheaply, the target computes the last token and the ``k`` guesses in one chunk of the
normal paged path, and ``rejection.verify`` keeps the longest prefix the target agrees with plus
one token of its own, with exactly the target's distribution.

More in docs/modules.md (folio/core/executor/runtime/spec_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.core.executor.model.loader import load_model
from folio.core.executor.model.layers import cpu_linear_packing_available, pack_linears_for_cpu
from folio.core.executor.sampling.rejection import processed_probs
from folio.core.executor.sampling.sampler import SamplingRow, position_seed

DRAFT_SEED_SALT = 0x5EED_D4AF7  # drafts draw from another stream than the target's samples


@dataclass(frozen=True)
class DraftTree:
    """The shape of a tree of drafts, its nodes in breadth-first order: ``parents[i]`` is node
    i's parent among the nodes, -1 for a child of the root (the last token the request has). A
    chain of k is ``(-1, 0, 1, .., k - 2)``. Any prefix of the nodes is a tree too (a parent comes
    before its children), so a step that verifies fewer drafts than were proposed keeps one."""

    parents: tuple[int, ...]

    def __post_init__(self):
        if len(self.parents) > 63:
            raise ValueError(f"a draft tree of {len(self.parents)} nodes: at most 63")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"draft tree parents {self.parents}: each must come before its node")

    @staticmethod
    def from_paths(paths) -> "DraftTree":
        """The tree of ``paths`` (each a list of child ranks from the root, Medusa's "choices":
        ``[[0], [1], [0, 0]]`` is the top two tokens and the top token after the first), sorted
        breadth-first; every path's parent path must be among them."""
        paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise ValueError("a draft tree is a non-empty list of non-empty paths of child ranks >= 0")
        missing = [list(p) for p in paths if len(p) > 1 and p[:-1] not in index]
        if missing:
            raise ValueError(f"draft tree paths {missing} lack their parent path")
        return DraftTree(tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths))

    def depths(self, n: int | None = None) -> np.ndarray:
        """[n + 1] int64: each position's depth, the root's (0) first."""
        n = len(self.parents) if n is None else n
        out = np.zeros(n + 1, dtype=np.int64)
        for i in range(n):
            out[i + 1] = out[self.parents[i] + 1] + 1
        return out

    def masks(self, n: int | None = None) -> np.ndarray:
        """[n + 1] uint64: bit j of entry i set when position i (0: the root) sees position j, its
        ancestors and itself (``AttentionMetadata.trees``)."""
        n = len(self.parents) if n is None else n
        out = np.ones(n + 1, dtype=np.uint64)
        for i in range(n):
            out[i + 1] = out[self.parents[i] + 1] | np.uint64(1 << (i + 1))
        return out

    def children(self, n: int | None = None) -> list[list[int]]:
        """Per position (0: the root), its children's positions in rank order."""
        n = len(self.parents) if n is None else n
        out: list[list[int]] = [[] for _ in range(n + 1)]
        for i in range(n):
            out[self.parents[i] + 1].append(i + 1)
        return out


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] q; None for a point mass
    tree: DraftTree | None = None  # the drafts' shape when they are a tree (point masses); None: a chain


class NgramProposer:
    def __init__(self, k: int, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, got {min_n}, {max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose_one(self, token_ids: list[int]) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix ([] if none).
        One vectorised comparison of every window per n: this runs for every request every step."""
        num = len(token_ids)
        if num < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # every earlier start, the suffix itself excluded
            hits = np.flatnonzero((windows == tokens[num - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + self.k]
        return []

    def propose(self, states) -> list[Proposal]:
        return [Proposal(self.propose_one(s.token_ids)) for s in states]

    def rollback(self, req_id: str, num_valid: int) -> None:
        pass

    def drop(self, req_id: str, token_ids: list[int] | None = None, adapter: int = 0) -> None:
        pass


@dataclass
class _DraftSeq:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV the draft's cache holds


class DraftModelProposer:
    def __init__(self, model_path: str, k: int, target_vocab_size: int, block_size: int, num_blocks: int,
                 device: torch.device, dtype: torch.dtype, backend):
        self.k = k
        self.model = load_model(model_path, dtype, device)
        if device.type == "cpu" and dtype == torch.float32 and cpu_linear_packing_available():
            pack_linears_for_cpu(self.model)
        spec = self.model.spec
        if spec.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({spec.vocab_size} tokens) is not the target's "
                             f"({target_vocab_size}): speculative decoding needs the same tokenizer")
        self.max_len = spec.max_position_embeddings
        shape = PoolShape(num_layers=spec.num_layers, block_size=block_size, num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, dtype=dtype)
        self.pool = KVPool(shape, num_blocks, device)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[str, _DraftSeq] = {}
        self.device, self.backend = device, backend
        self.generator = torch.Generator(device=device)

    # ------------------------------------------------------------------ cache bookkeeping
    def drop(self, req_id: str, token_ids: list[int] | None = None, adapter: int = 0) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self.free.extend(reversed(seq.block_ids))

    def rollback(self, req_id: str, num_valid: int) -> None:
        seq = self.seqs.get(req_id)
        if seq is not None:
            seq.num_computed = min(seq.num_computed, num_valid)

    def _reserve(self, req_id: str, num_tokens: int) -> _DraftSeq | None:
        """Blocks for ``num_tokens`` tokens, or None when the draft pool cannot hold them."""
        seq = self.seqs.setdefault(req_id, _DraftSeq())
        need = -(-num_tokens // self.pool.block_size) - len(seq.block_ids)
        if need > len(self.free) or num_tokens > self.max_len:
            return None
        seq.block_ids.extend(self.free.pop() for _ in range(max(0, need)))
        return seq

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, states) -> list[Proposal]:
        """``k`` drafts for each state (its ``token_ids`` end with the token just sampled)."""
        out = [Proposal([]) for _ in states]
        live = []  # (index into states, its draft seq)
        for i, state in enumerate(states):
            seq = self._reserve(state.req_id, len(state.token_ids) + self.k - 1)
            if seq is not None:
                live.append((i, seq))
        if not live:
            return out
        drafts: dict[int, list[int]] = {i: [] for i, _ in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _ in live}
        for round_no in range(self.k):
            chunks = []
            for i, seq in live:
                tokens = states[i].token_ids + drafts[i]
                chunks.append(tokens[seq.num_computed:] if round_no == 0 else [drafts[i][-1]])
            logits = self._forward([seq for _, seq in live], chunks)
            rows = [self._row(states[i], drafts[i]) for i, _ in live]
            q = processed_probs(logits, rows)
            for row, (i, _) in enumerate(live):
                token = self._draw(q[row], states[i], len(drafts[i]))
                drafts[i].append(token)
                probs[i].append(q[row])
        for i, _ in live:
            out[i] = Proposal(drafts[i], torch.stack(probs[i]))
        return out

    def _forward(self, seqs: list[_DraftSeq], chunks: list[list[int]]) -> torch.Tensor:
        """One varlen step of the draft model; the logits at each chunk's last token."""
        counts = [len(c) for c in chunks]
        seq_lens = [seq.num_computed + n for seq, n in zip(seqs, counts)]
        meta = AttentionMetadata.build(counts, seq_lens, [s.block_ids for s in seqs], None, self.pool.block_size,
                                       self.device)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.device)
        hidden = self.model(ids, meta.positions, self.pool.kv_caches, meta, self.backend)
        last = torch.tensor([sum(counts[:j + 1]) - 1 for j in range(len(counts))], device=self.device)
        for seq, n in zip(seqs, counts):
            seq.num_computed += n
        return self.model.compute_logits(hidden[last])

    @staticmethod
    def _row(state, drafts: list[int]) -> SamplingRow:
        return SamplingRow(state.sampling, None, state.token_ids[:state.num_prompt_tokens],
                           state.output_token_ids + drafts)

    def _draw(self, q: torch.Tensor, state, num_drafted: int) -> int:
        if state.sampling.greedy:
            return int(q.argmax())
        generator = None
        if state.sampling.seed is not None:  # reproducible drafts, so a seeded request stays reproducible
            position = len(state.output_token_ids) + num_drafted
            self.generator.manual_seed(position_seed(state.sampling.seed ^ DRAFT_SEED_SALT, position))
            generator = self.generator
        return int(torch.multinomial(q, 1, generator=generator))

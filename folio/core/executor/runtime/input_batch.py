"""The persistent input batch: one row per request the executor holds, in preallocated arrays.

vLLM V1's shape. Token ids, counts, block tables and sampling parameters of every request live in
host arrays (numpy; a row per request, reused when a request leaves) that each step updates from
the plan's diffs: a new request writes its row once, a running one moves its count and appends
its new blocks and tokens. A step's inputs and attention metadata are then gathered from the
rows with vectorised operations (no Python loop over tokens) into one staging buffer, which
reaches the device in one copy (pinned, two buffers in turn so that a copy in flight is never
overwritten); the step's tensors are views of it. On the CPU the gathered arrays are the tensors.

The runner (``runner.py``) owns one; the sampler reads its parameter rows and penalty state
(``penalties.py``), and ``last_sampled`` keeps each row's latest sampled token on the device, for a
step that feeds it back without a round trip through the host.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass

import numpy as np
import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.sampling.penalties import PenaltyState, has_penalties
from folio.core.executor.sampling.philox import draw_seed, seed_words
from folio.core.executor.kernels.sampler_columns import NUM_PARAMS, column_values

NO_LOGPROBS = -1


@dataclass
class StepInputs:
    """One step's batch, gathered from the rows."""

    input_ids: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_idx: torch.Tensor  # [num_logit_rows] int64: tokens whose logits the step samples from
    rows: np.ndarray  # [num_seqs] the row of each scheduled sequence, in plan order
    counts: np.ndarray  # [num_seqs] tokens computed per sequence
    samples: np.ndarray  # [num_seqs] bool: the sequence samples (its chunk reaches its last token)
    num_spec: np.ndarray  # [num_seqs] drafts verified per sequence
    sample_rows: np.ndarray  # [num_plain] rows that sample one token without drafts, in plan order
    sample_rows_dev: torch.Tensor  # the same on the device
    sample_params: torch.Tensor  # [num_plain, NUM_PARAMS] fp32, their sampling parameters
    # pooling requests whose chunk reaches their last prompt token: they pool there and never sample
    pools: np.ndarray | None = None  # [num_seqs] bool
    pool_idx: np.ndarray | None = None  # [num_pooling] the index of that last token in the step's tokens


def _tree_positions(positions: np.ndarray, trees: dict, num_scheduled: dict[str, int], counts: np.ndarray,
                    num_spec: np.ndarray, start: np.ndarray, query_start: np.ndarray) -> tuple[np.ndarray, dict]:
    """The step's RoPE positions with each tree draft's nodes at their depth's position, and each
    tree sequence's ancestor masks (``AttentionMetadata.trees``)."""
    rope_positions, masks = positions.copy(), {}
    for i, req_id in enumerate(num_scheduled):
        tree = trees.get(req_id)
        if tree is None or not num_spec[i]:
            continue
        if counts[i] != num_spec[i] + 1:
            raise ValueError(f"{req_id}: a tree draft's chunk is its root and its {num_spec[i]} nodes, "
                             f"not {counts[i]} tokens")
        first = int(query_start[i])
        rope_positions[first:first + counts[i]] = start[i] + tree.depths(int(num_spec[i]))
        masks[i] = tree.masks(int(num_spec[i]))
    return rope_positions, masks


def _opens_one_block(diff) -> bool:
    return len(diff.new_block_ids) == 1 and diff.block_ids is None and not diff.new_token_ids


def _grow(array: np.ndarray, rows: int | None = None, cols: int | None = None) -> np.ndarray:
    shape = (rows or array.shape[0],) + ((cols or array.shape[1],) if array.ndim == 2 else ())
    out = np.zeros(shape, dtype=array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


class InputBatch:
    def __init__(self, max_num_reqs: int, vocab_size: int, block_size: int, device: torch.device):
        cap = max(1, max_num_reqs)
        self.vocab_size, self.block_size, self.device = vocab_size, block_size, device
        self.token_ids = np.zeros((cap, 256), dtype=np.int64)  # [rows, width]; widths double on demand
        self.num_tokens = np.zeros(cap, dtype=np.int64)  # tokens the request has (prompt + output)
        self.num_prompt = np.zeros(cap, dtype=np.int64)
        self.num_computed = np.zeros(cap, dtype=np.int64)
        self.block_table = np.zeros((cap, 16), dtype=np.int32)
        self.num_blocks = np.zeros(cap, dtype=np.int64)
        self.params = np.zeros((cap, NUM_PARAMS), dtype=np.float32)
        self.greedy = np.zeros(cap, dtype=bool)
        self.penalised = np.zeros(cap, dtype=bool)
        self.repetition = np.zeros(cap, dtype=bool)
        self.appends = np.zeros(cap, dtype=bool)  # False for beams: the scheduler sends their tokens
        self.pooling = np.zeros(cap, dtype=bool)  # the row pools its prompt (``SamplingParams.pooling``)
        self.num_logprobs = np.full(cap, NO_LOGPROBS, dtype=np.int64)
        self.lora_ids = np.zeros(cap, dtype=np.int64)  # the row's LoRA adapter (the manager's id; 0: none)
        # the key of the row's uniforms (sampling/philox.py): its request's seed, or a random one
        # drawn when the request joined (int64 holding the 64 bits)
        self.seeds = np.zeros(cap, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(cap))  # a heap: the lowest free row first, so that a batch's rows
        # stay a run of consecutive rows as long as requests come and go together (the sampler then
        # reads their penalty state in place)
        self.penalties = PenaltyState(cap, vocab_size, device)
        self.last_sampled = torch.zeros(cap, dtype=torch.long, device=device)
        self._pin = device.type == "cuda"
        self._staging = [self._new_staging(1 << 16), self._new_staging(1 << 16)] if device.type != "cpu" else []
        self._turn = 0

    # ------------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        return len(self.num_tokens)

    def _grow_rows(self) -> None:
        old, cap = self.capacity, 2 * self.capacity
        for name in ("token_ids", "num_tokens", "num_prompt", "num_computed", "block_table", "num_blocks", "params",
                     "greedy", "penalised", "repetition", "appends", "pooling", "lora_ids", "seeds"):
            setattr(self, name, _grow(getattr(self, name), rows=cap))
        self.num_logprobs = np.concatenate([self.num_logprobs, np.full(cap - old, NO_LOGPROBS, dtype=np.int64)])
        self.free_rows += range(old, cap)  # it grows only when no row is free: a sorted list is a heap
        self.penalties.grow(cap)
        self.last_sampled = torch.cat([self.last_sampled, torch.zeros(cap - old, dtype=torch.long, device=self.device)])

    def _fit_tokens(self, n: int) -> None:
        if n > self.token_ids.shape[1]:
            self.token_ids = _grow(self.token_ids, cols=max(n, 2 * self.token_ids.shape[1]))

    def _fit_blocks(self, n: int) -> None:
        if n > self.block_table.shape[1]:
            self.block_table = _grow(self.block_table, cols=max(n, 2 * self.block_table.shape[1]))

    # ------------------------------------------------------------------ diffs
    def add(self, req_id: str, token_ids: list[int], num_prompt: int, num_computed: int, block_ids: list[int],
            sampling, append_sampled: bool = True, lora_id: int = 0) -> int:
        if req_id in self.row_of:
            self.remove(req_id)
        if not self.free_rows:
            self._grow_rows()
        row = heapq.heappop(self.free_rows)
        self.row_of[req_id] = row
        self._fit_tokens(len(token_ids) + 1)
        self._fit_blocks(len(block_ids))
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row], self.num_prompt[row], self.num_computed[row] = len(token_ids), num_prompt, num_computed
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self.params[row] = column_values(sampling, self.vocab_size)
        self.greedy[row] = sampling.greedy
        self.penalised[row] = has_penalties(sampling)
        self.repetition[row] = sampling.repetition_penalty != 1.0
        self.num_logprobs[row] = NO_LOGPROBS if sampling.engine_logprobs is None else sampling.engine_logprobs
        self.seeds[row] = seed_words(sampling.seed) if sampling.seed is not None else draw_seed()
        self.appends[row] = append_sampled
        self.pooling[row] = sampling.pooling is not None
        self.lora_ids[row] = lora_id
        self.penalties.set_row(row, sampling, token_ids[:num_prompt], token_ids[num_prompt:])
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            heapq.heappush(self.free_rows, row)

    def apply_running(self, running, step_id: int) -> None:
        """The per-step diffs of requests already held: counts in one assignment, a decode's one
        new block in another, other blocks and tokens only for the requests whose blocks or
        tokens changed."""
        if not running:
            return
        try:
            rows = [self.row_of[r.req_id] for r in running]
        except KeyError as exc:
            raise KeyError(f"step {step_id} names unknown request {exc.args[0]!r}") from None
        self.num_computed[rows] = [r.num_computed_tokens for r in running]
        changed = [(row, r) for row, r in zip(rows, running) if r.new_block_ids or r.block_ids is not None
                   or r.new_token_ids]
        if changed:
            self._apply_changes(changed)

    def _apply_changes(self, changed: list) -> None:
        """(row, diff) of the requests whose blocks or tokens changed: a decode that opens one
        block (the usual change) goes into one assignment with the others like it."""
        opened = [(row, r.new_block_ids[0]) for row, r in changed if _opens_one_block(r)]
        if opened:
            rows, blocks = (list(c) for c in zip(*opened))
            ends = self.num_blocks[rows]
            self._fit_blocks(int(ends.max()) + 1)
            self.block_table[rows, ends] = blocks
            self.num_blocks[rows] = ends + 1
        for row, r in changed:
            if _opens_one_block(r):
                continue
            if r.block_ids is not None:  # copy-on-write changed blocks inside the table
                self.num_blocks[row] = 0
                self.append_blocks(row, r.block_ids)
            self.append_blocks(row, r.new_block_ids)
            self.append_tokens(row, r.new_token_ids)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            n = int(self.num_blocks[row])
            self._fit_blocks(n + len(block_ids))
            self.block_table[row, n : n + len(block_ids)] = block_ids
            self.num_blocks[row] = n + len(block_ids)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        if token_ids:
            n = int(self.num_tokens[row])
            self._fit_tokens(n + len(token_ids) + 1)
            self.token_ids[row, n : n + len(token_ids)] = token_ids
            self.num_tokens[row] = n + len(token_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One token for each of ``rows`` (distinct), vectorised."""
        if len(rows):
            ends = self.num_tokens[rows]
            self._fit_tokens(int(ends.max()) + 2)
            self.token_ids[rows, ends] = token_ids
            self.num_tokens[rows] = ends + 1

    def tokens(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_tokens[row]]

    # ------------------------------------------------------------------ one step
    def prepare(self, num_scheduled: dict[str, int], spec_token_ids: dict[str, list[int]],
                trees: dict | None = None) -> StepInputs:
        """Gather the step's inputs from the rows, for a plan ``plan_check.check_plan`` passed (the
        positions, slots and block-table reads below are not checked again). ``trees``: requests
        whose drafts are a tree (``DraftTree``): their chunk is the root and its nodes, each node
        in the slot after the one before (breadth-first) but at the position of its depth, and
        attending its own path alone."""
        num_seqs = len(num_scheduled)
        try:
            found = operator.itemgetter(*num_scheduled)(self.row_of) if num_seqs else ()  # a tuple, or one row
        except KeyError as exc:
            raise KeyError(f"the step schedules unknown request {exc.args[0]!r}") from None
        rows = np.array(found if num_seqs != 1 else (found,), dtype=np.int64)
        counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=num_seqs)
        num_spec = np.zeros(num_seqs, dtype=np.int64)
        if spec_token_ids:  # drafts sit after the row's last token, uncounted
            order = {req_id: i for i, req_id in enumerate(num_scheduled)}
            for req_id, drafts in spec_token_ids.items():
                if drafts and req_id in order:
                    i, row = order[req_id], self.row_of[req_id]
                    n = int(self.num_tokens[row])
                    self._fit_tokens(n + len(drafts) + 1)
                    self.token_ids[row, n : n + len(drafts)] = drafts
                    num_spec[i] = len(drafts)
        start, have = self.num_computed[rows], self.num_tokens[rows]
        end = start + counts - num_spec  # the real tokens each computes; its drafts follow them
        seq_lens = start + counts
        need = (seq_lens + self.block_size - 1) // self.block_size
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        num_tokens = int(query_start[-1])
        samples = end == have
        pools = None
        if self.pooling[rows].any():  # they reach their last prompt token to pool there, not to sample
            pools = samples & self.pooling[rows]
            samples = samples & ~pools
        plain = samples & (num_spec == 0)
        if num_tokens == num_seqs:  # decodes only: a token per sequence, no drafts
            token_rows, positions, logits_idx = rows, start, np.flatnonzero(samples)
        else:
            token_rows = np.repeat(rows, counts)
            positions = np.arange(num_tokens) + np.repeat(start - query_start[:-1], counts)
            num_logits = np.where(samples, num_spec + 1, 0)
            logit_starts = np.repeat(query_start[1:] - num_logits, num_logits)
            logits_idx = logit_starts + np.arange(len(logit_starts)) \
                - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
        sample_rows = rows[plain]
        max_blocks = max(1, int(need.max(initial=1)))
        rope_positions, tree_masks = _tree_positions(positions, trees, num_scheduled, counts, num_spec, start,
                                                     query_start) if trees else (positions, None)
        dev = self._to_device({
            "input_ids": self.token_ids[token_rows, positions],
            "positions": rope_positions,
            "slot_mapping": self.block_table[token_rows, positions // self.block_size].astype(np.int64)
            * self.block_size + positions % self.block_size,
            "logits_idx": logits_idx,
            "sample_rows": sample_rows,
            "query_start_loc": query_start.astype(np.int32),
            "seq_lens": seq_lens.astype(np.int32),
            "block_tables": self.block_table[rows, :max_blocks],
            "sample_params": self.params[sample_rows],
        })
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"], query_start_loc=dev["query_start_loc"], seq_lens=dev["seq_lens"],
            block_tables=dev["block_tables"].view(num_seqs, max_blocks), max_query_len=int(counts.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)), block_size=self.block_size, query_lens_list=counts.tolist(),
            seq_lens_list=seq_lens.tolist(), positions=dev["positions"], padded=False, trees=tree_masks or None,
        )
        return StepInputs(dev["input_ids"], meta, dev["logits_idx"], rows, counts, samples, num_spec, sample_rows,
                          dev["sample_rows"], dev["sample_params"].view(-1, NUM_PARAMS), pools,
                          None if pools is None else query_start[1:][pools] - 1)

    def _new_staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def _to_device(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Pack the arrays into the staging buffer (8-byte aligned) and move it in one copy; on the
        CPU the arrays (each made afresh for the step) are the tensors."""
        if self.device.type == "cpu":
            return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        offsets, total = {}, 0
        for name, a in arrays.items():
            offsets[name] = total
            total += -(-a.nbytes // 8) * 8
        if total > self._staging[self._turn].numel():
            self._staging[self._turn] = self._new_staging(2 * total)
        staging = self._staging[self._turn]
        self._turn ^= 1
        host = staging.numpy()
        for name, a in arrays.items():
            host[offsets[name] : offsets[name] + a.nbytes].view(a.dtype)[:] = a.ravel()
        dev = staging[:total].to(self.device, non_blocking=True)
        return {name: dev[offsets[name] : offsets[name] + a.nbytes].view(_TORCH[a.dtype]) for name, a in arrays.items()}

    # ------------------------------------------------------------------ sampling state
    def keys(self, sample_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sample rows' seeds and output positions (tokens generated so far), [n] int64 each:
        the keys of their uniforms for the token they sample now."""
        return self.seeds[sample_rows], self.num_tokens[sample_rows] - self.num_prompt[sample_rows]


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}

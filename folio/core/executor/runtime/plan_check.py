"""A step plan checked against the executor before any of it is applied: ``check_plan``.

Block ids, slots and positions cross the socket in a ``StepPlan`` and become raw offsets in the
kernels (the C kernels write a token's K and V at ``table[p // block_size] * block_size + p %
block_size`` and read row ``p`` of the RoPE tables, unchecked). ``check_plan`` proves, over the
plan and the persistent batch as the plan finds it (``input_batch.py``), that every block id lies
in its pool, every token id in the vocabulary, every scheduled request is held or new, its
chunk within the tokens it has, its positions within the RoPE tables and its block table long
enough for them, and that drafts, copies and adapters fit; otherwise it raises ``InvalidPlan``
naming the request and the value. The runner (``runner.py``) calls it before it changes anything,
so a refused plan leaves the executor as it was. Token and block ids are checked with numpy over
the plan's flattened lists, the counts over the step's arrays: no Python loop runs per token.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from folio.shared.messages import NewRequestData, RunningRequestData, StepPlan


class InvalidPlan(ValueError):
    """A step plan that does not fit this executor; nothing of it was applied."""


@dataclass(frozen=True)
class PlanLimits:
    """The executor's fixed sizes a plan is checked against."""

    num_blocks: int  # device pool
    num_host_blocks: int  # host tier (0: none)
    block_size: int
    max_positions: int  # rows of the RoPE tables: every position lies below
    vocab_size: int
    disk_tier: bool = False
    max_loras: int = 0  # adapters one step may use (0: LoRA off)
    takes_images: bool = False  # the model has a vision tower
    images_both_ways: bool = False  # its images' placeholders attend each other both ways (``ImageInput.both_ways``)


@dataclass
class _Scheduled:
    """The scheduled requests' state as the plan's diffs leave it, in plan order."""

    req_ids: list[str]
    counts: np.ndarray  # [n] tokens scheduled
    start: np.ndarray  # [n] tokens computed before the step
    have: np.ndarray  # [n] tokens the request has
    num_blocks: np.ndarray  # [n] its block table's length
    rows: np.ndarray  # [n] its row of the batch (-1: new in this plan)


def check_plan(plan: StepPlan, limits: PlanLimits, batch, adapters: Mapping[str, int] | None = None) -> None:
    """Raise ``InvalidPlan`` for the first thing in ``plan`` that does not fit. ``batch`` is the
    runner's ``InputBatch`` with the plan's finished requests already dropped; ``adapters``: the
    registered LoRA adapters' ids by name (None: LoRA off)."""
    _check_copies(plan, limits)
    new = _check_new(plan.new_reqs, limits, adapters)
    running = _check_running(plan.running_reqs, limits, batch, new)
    if not plan.num_scheduled_tokens:
        if plan.spec_token_ids:
            raise InvalidPlan(f"step {plan.step_id}: drafts for {next(iter(plan.spec_token_ids))!r}, which is not scheduled")
        return
    step = _scheduled(plan, batch, new, running)
    num_spec = _check_drafts(plan, step, limits)
    _check_chunks(step, num_spec, limits)
    if adapters is not None:
        _check_adapters(step, batch, new, adapters, limits)


# ---------------------------------------------------------------------- ids in ranges
def _first_outside(kind: str, owners: list[str], lists: list, low: int, high: int, where: str) -> None:
    """Raise for the first id of ``lists`` (one list per owner) outside ``[low, high)``."""
    try:
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        flat = None  # an id beyond int64, or not an integer: found below
    if flat is not None:
        if not len(flat) or (flat.min() >= low and flat.max() < high):
            return
        at = int(np.argmax((flat < low) | (flat >= high)))
        i = int(np.searchsorted(np.cumsum([len(ids) for ids in lists]), at, side="right"))
        raise InvalidPlan(f"{owners[i]}: {kind} {int(flat[at])} is outside {where}")
    for owner, ids in zip(owners, lists):
        for value in ids:
            if not isinstance(value, int) or not low <= value < high:
                raise InvalidPlan(f"{owner}: {kind} {value!r} is outside {where}")


def _pool(limits: PlanLimits) -> str:
    return f"the pool (0..{limits.num_blocks - 1})"


def _vocab(limits: PlanLimits) -> str:
    return f"the vocabulary (0..{limits.vocab_size - 1})"


def _check_pairs(name: str, pairs, highs: tuple[int, int], tiers: tuple[str, str]) -> None:
    if not pairs:
        return
    try:
        a = np.array([tuple(p)[:2] for p in pairs], dtype=np.int64).reshape(len(pairs), 2)
    except (OverflowError, TypeError, ValueError):
        raise InvalidPlan(f"{name}: not pairs of block ids: {pairs[:4]!r}") from None
    bad = (a < 0) | (a >= np.array(highs))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidPlan(f"{name}[{i}] = {tuple(a[i].tolist())}: block {int(a[i, j])} is outside the "
                          f"{tiers[j]} (0..{highs[j] - 1})")


def _check_copies(plan: StepPlan, limits: PlanLimits) -> None:
    """Copy-on-write, swap and disk-tier pairs inside their pools."""
    n, h = limits.num_blocks, limits.num_host_blocks
    if (plan.swap_out or plan.swap_in) and not h:
        raise InvalidPlan(f"step {plan.step_id} swaps blocks but this executor has no host tier")
    if (plan.tier_saves or plan.tier_loads) and not limits.disk_tier:
        raise InvalidPlan(f"step {plan.step_id} moves blocks to or from disk but this executor has no disk tier")
    _check_pairs("block_copies", plan.block_copies, (n, n), ("device pool", "device pool"))
    _check_pairs("swap_out", plan.swap_out, (n, h), ("device pool", "host tier"))
    _check_pairs("swap_in", plan.swap_in, (h, n), ("host tier", "device pool"))
    for i, (tier, block_id, _) in enumerate(plan.tier_saves):
        if tier not in (0, 1) or not 0 <= block_id < (n if tier == 0 else h):
            raise InvalidPlan(f"tier_saves[{i}]: block {block_id} of tier {tier} is outside its pool")
    if plan.tier_loads:
        _first_outside("block id", ["tier_loads"], [[b for b, _ in plan.tier_loads]], 0, n, _pool(limits))
    if plan.kv_loads:  # -1: a block the prefix cache holds, not pulled
        _first_outside("block id", [load.req_id for load in plan.kv_loads], [load.block_ids for load in plan.kv_loads],
                       -1, n, _pool(limits))


# ---------------------------------------------------------------------- the plan's diffs
def _check_new(new_reqs: list[NewRequestData], limits: PlanLimits,
               adapters: Mapping[str, int] | None) -> dict[str, NewRequestData]:
    new: dict[str, NewRequestData] = {}
    for r in new_reqs:
        if r.req_id in new:
            raise InvalidPlan(f"{r.req_id}: named twice among the new requests")
        num_tokens = len(r.token_ids)
        if not 0 <= r.num_prompt_tokens <= num_tokens or not 0 <= r.num_computed_tokens <= num_tokens:
            raise InvalidPlan(f"{r.req_id}: {r.num_prompt_tokens} prompt and {r.num_computed_tokens} computed tokens "
                              f"of {num_tokens}")
        if r.lora_name is not None and (adapters is None or r.lora_name not in adapters):
            raise InvalidPlan(f"{r.req_id}: LoRA adapter {r.lora_name!r} asked but "
                              + ("LoRA is not enabled" if adapters is None else "no adapter has that name"))
        if r.images:
            _check_images(r, limits)
        new[r.req_id] = r
    if new_reqs:
        owners = list(new)
        _first_outside("token id", owners, [r.token_ids for r in new_reqs], 0, limits.vocab_size, _vocab(limits))
        _first_outside("block id", owners, [r.block_ids for r in new_reqs], 0, limits.num_blocks, _pool(limits))
    return new


def _check_images(r: NewRequestData, limits: PlanLimits) -> None:
    """Images only for a model with a tower, marked as its attention reads them (``both_ways``),
    their placeholders inside the prompt, their pixel bytes the size their dtype and shape say, a
    patch grid (where one is given) that holds the patches."""
    if not limits.takes_images:
        raise InvalidPlan(f"{r.req_id}: images sent to a text-only model")
    for k, im in enumerate(r.images):
        if im.both_ways != limits.images_both_ways:  # the scheduler would split an image the model sees whole
            raise InvalidPlan(f"{r.req_id}: image {k} is marked both_ways={im.both_ways} for a model whose images "
                              f"attend {'both ways' if limits.images_both_ways else 'causally'}")
        if im.length <= 0 or im.offset < 0 or im.offset + im.length > r.num_prompt_tokens:
            raise InvalidPlan(f"{r.req_id}: image {k}'s placeholders [{im.offset}, {im.offset + im.length}) are "
                              f"outside its {r.num_prompt_tokens} prompt tokens")
        try:
            size = int(np.prod(im.shape, dtype=np.int64)) * np.dtype(im.dtype).itemsize
        except (TypeError, ValueError):
            raise InvalidPlan(f"{r.req_id}: image {k} has pixel dtype {im.dtype!r}") from None
        if size != len(im.data) or np.dtype(im.dtype).kind != "f":
            raise InvalidPlan(f"{r.req_id}: image {k} has {len(im.data)} bytes for {im.dtype} {im.shape}")
        if im.grid and (len(im.grid) != 3 or min(im.grid) < 1 or int(np.prod(im.grid)) != im.shape[0]):
            raise InvalidPlan(f"{r.req_id}: image {k}'s patch grid {im.grid} does not hold its {im.shape[0]} patches")


def _check_running(running_reqs: list[RunningRequestData], limits: PlanLimits, batch,
                   new: dict[str, NewRequestData]) -> dict[str, RunningRequestData]:
    running: dict[str, RunningRequestData] = {}
    row_of = batch.row_of
    for r in running_reqs:
        if r.req_id in running or r.req_id in new:
            raise InvalidPlan(f"{r.req_id}: named twice in the plan")
        row = row_of.get(r.req_id)
        if row is None:
            raise InvalidPlan(f"the step names unknown request {r.req_id!r}")
        have = int(batch.num_tokens[row]) + len(r.new_token_ids)
        if not 0 <= r.num_computed_tokens <= have:
            raise InvalidPlan(f"{r.req_id}: {r.num_computed_tokens} tokens computed of {have}")
        running[r.req_id] = r
    if running_reqs:
        owners = [r.req_id for r in running_reqs]
        _first_outside("block id", owners, [r.new_block_ids if r.block_ids is None else [*r.new_block_ids, *r.block_ids]
                                            for r in running_reqs], 0, limits.num_blocks, _pool(limits))
        if any(r.new_token_ids for r in running_reqs):
            _first_outside("token id", owners, [r.new_token_ids for r in running_reqs], 0, limits.vocab_size,
                           _vocab(limits))
    return running


# ---------------------------------------------------------------------- the step
def _scheduled(plan: StepPlan, batch, new: dict[str, NewRequestData],
               running: dict[str, RunningRequestData]) -> _Scheduled:
    """The scheduled requests' counts and state after the diffs, vectorised over the held ones;
    the requests with a diff are patched one by one (a decode that opened a block, a new one)."""
    num_scheduled = plan.num_scheduled_tokens
    req_ids = list(num_scheduled)
    n = len(req_ids)
    try:
        counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=n)
    except (OverflowError, TypeError, ValueError):
        bad = next(r for r, c in num_scheduled.items() if not isinstance(c, int) or abs(c) >= 1 << 63)
        raise InvalidPlan(f"{bad}: {num_scheduled[bad]!r} tokens scheduled") from None
    row_of = batch.row_of
    if not new:
        try:
            found = operator.itemgetter(*req_ids)(row_of)
        except KeyError as exc:
            raise InvalidPlan(f"the step schedules unknown request {exc.args[0]!r}") from None
        rows = np.array(found if n != 1 else (found,), dtype=np.int64)
    else:
        rows = np.array([-1 if r in new else row_of.get(r, -2) for r in req_ids], dtype=np.int64)
        if (rows == -2).any():
            raise InvalidPlan(f"the step schedules unknown request {req_ids[int(np.argmax(rows == -2))]!r}")
    held = np.maximum(rows, 0)
    step = _Scheduled(req_ids, counts, batch.num_computed[held], batch.num_tokens[held], batch.num_blocks[held], rows)
    if new or running:
        order = {r: i for i, r in enumerate(req_ids)}
        for r in running.values():
            if (i := order.get(r.req_id)) is not None:
                step.start[i] = r.num_computed_tokens
                step.have[i] += len(r.new_token_ids)
                base = len(r.block_ids) if r.block_ids is not None else step.num_blocks[i]
                step.num_blocks[i] = base + len(r.new_block_ids)
        for r in new.values():
            if (i := order.get(r.req_id)) is not None:
                step.start[i], step.have[i], step.num_blocks[i] = r.num_computed_tokens, len(r.token_ids), len(r.block_ids)
    return step


def _check_drafts(plan: StepPlan, step: _Scheduled, limits: PlanLimits) -> np.ndarray:
    """[n] drafts each scheduled request verifies; they must be scheduled and in the vocabulary."""
    num_spec = np.zeros(len(step.req_ids), dtype=np.int64)
    if not plan.spec_token_ids:
        return num_spec
    order = {r: i for i, r in enumerate(step.req_ids)}
    owners, lists = [], []
    for req_id, drafts in plan.spec_token_ids.items():
        if req_id not in order:
            raise InvalidPlan(f"step {plan.step_id}: drafts for {req_id!r}, which is not scheduled")
        num_spec[order[req_id]] = len(drafts)
        owners.append(req_id)
        lists.append(drafts)
    _first_outside("draft token id", owners, lists, 0, limits.vocab_size, _vocab(limits))
    return num_spec


def _check_chunks(step: _Scheduled, num_spec: np.ndarray, limits: PlanLimits) -> None:
    """Each chunk within the tokens its request has, its positions within the RoPE tables, its
    block table long enough for them: a few reductions over the step's arrays, and the culprit
    looked for only when one fails. ``0 <= start <= have`` holds already (the batch keeps it, the
    diffs were checked for it) and the counts are bounded first, so no sum below overflows."""
    counts, start, have = step.counts, step.start, step.have
    num_real = counts - num_spec  # the tokens it computes; its drafts follow them
    if num_real.min() < 1 or counts.max() > limits.max_positions:
        i = int(np.argmax((num_real < 1) | (counts > limits.max_positions)))
        raise InvalidPlan(f"{step.req_ids[i]}: {counts[i]} tokens scheduled"
                          + (f" for {num_spec[i]} drafts" if num_spec[i] else ""))
    end, seq_lens = start + num_real, start + counts
    bad_tokens = (end > have) if not num_spec.any() else (end > have) | ((num_spec > 0) & (end != have))
    if bad_tokens.any() or seq_lens.max() > limits.max_positions or (seq_lens > step.num_blocks * limits.block_size).any():
        _name_chunk(step, num_spec, bad_tokens, seq_lens, limits)


def _name_chunk(step: _Scheduled, num_spec: np.ndarray, bad_tokens: np.ndarray, seq_lens: np.ndarray,
                limits: PlanLimits) -> None:
    bad_positions = seq_lens > limits.max_positions
    bad_blocks = seq_lens > step.num_blocks * limits.block_size
    i = int(np.argmax(bad_tokens | bad_positions | bad_blocks))
    req_id, counts, start, have = step.req_ids[i], step.counts, step.start, step.have
    if bad_tokens[i]:
        raise InvalidPlan(f"{req_id}: {counts[i]} tokens scheduled but only {have[i] - start[i]} to compute"
                          + (f" and {num_spec[i]} drafts" if num_spec[i] else ""))
    if bad_positions[i]:
        raise InvalidPlan(f"{req_id}: position {seq_lens[i] - 1} is outside the RoPE tables "
                          f"(0..{limits.max_positions - 1})")
    raise InvalidPlan(f"{req_id}: {seq_lens[i]} tokens need more than its {step.num_blocks[i]} blocks")


def _check_adapters(step: _Scheduled, batch, new: dict[str, NewRequestData], adapters: Mapping[str, int],
                    limits: PlanLimits) -> None:
    """The step's adapters still registered, and no more of them than device slots."""
    held = step.rows >= 0
    ids = batch.lora_ids[step.rows[held]]
    registered: Collection[int] = set(adapters.values())
    gone = ids[(ids > 0) & ~np.isin(ids, list(registered))]
    if len(gone):
        i = int(np.flatnonzero(held)[int(np.argmax(np.isin(ids, gone)))])
        raise InvalidPlan(f"{step.req_ids[i]}: its LoRA adapter was removed")
    distinct = set(ids[ids > 0].tolist()) | {adapters[r.lora_name] for r in new.values() if r.lora_name is not None}
    if len(distinct) > limits.max_loras:
        raise InvalidPlan(f"{len(distinct)} LoRA adapters in one step, more than max_loras {limits.max_loras}")

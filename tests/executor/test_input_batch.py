"""The persistent batch against a from-scratch rebuild of every step (the way the runner built its
inputs before: Python lists per request, then ``AttentionMetadata.build``), over random plan
sequences with joins, leaves, forks, preemptions (a request leaves and comes back whole), drafts,
tokens appended by the scheduler, copy-on-write tables and rows reused after leaving."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.runtime.input_batch import InputBatch
from folio.core.executor.runtime.plan_check import InvalidPlan, PlanLimits, check_plan
from folio.core.executor.kernels.sampler_columns import NUM_PARAMS, column_values
from folio.shared.messages import NewRequestData, RunningRequestData, StepPlan
from folio.shared.sampling import SamplingParams

VOCAB, BS = 97, 4


@dataclass
class Req:
    tokens: list[int]
    num_prompt: int
    blocks: list[int]
    params: SamplingParams
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)


class World:
    """What the scheduler knows, and the diffs it sends."""

    def __init__(self, rng: random.Random):
        self.rng, self.reqs, self.next_block, self.next_id = rng, {}, 0, 0

    def blocks(self, n):
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def params(self):
        r = self.rng
        return SamplingParams(temperature=r.choice([0.0, 0.7]), top_p=r.choice([1.0, 0.9]), seed=r.choice([None, 5]),
                              presence_penalty=r.choice([0.0, 0.5]))

    def join(self, new_reqs, req_id=None, tokens=None, num_prompt=None, params=None, computed=0, blocks=None):
        r = self.rng
        if req_id is None:
            req_id, self.next_id = f"r{self.next_id}", self.next_id + 1
            num_prompt = r.randrange(1, 12)
            tokens = [r.randrange(VOCAB) for _ in range(num_prompt + r.choice([0, 0, 3]))]
        req = Req(list(tokens), num_prompt, list(blocks or []), params or self.params(), computed)
        self.reqs[req_id] = req
        new_reqs.append((req_id, req))

    def step(self):
        r = self.rng
        finished, new_reqs, running = [], [], []
        for req_id in list(self.reqs):
            if r.random() < 0.1:  # leaves
                finished.append(req_id)
                del self.reqs[req_id]
            elif r.random() < 0.08:  # preempted by recompute: leaves and comes back whole
                req = self.reqs.pop(req_id)
                finished.append(req_id)
                self.join(new_reqs, req_id, req.tokens, req.num_prompt, req.params)
        for _ in range(r.randrange(0, 3)):
            self.join(new_reqs)
        if self.reqs and r.random() < 0.2:  # a fork shares its parent's tokens, blocks and count
            parent = self.reqs[r.choice(list(self.reqs))]
            req_id, self.next_id = f"r{self.next_id}", self.next_id + 1
            self.join(new_reqs, req_id, parent.tokens, parent.num_prompt, parent.params, parent.num_computed,
                      parent.blocks)
        joined = {req_id for req_id, _ in new_reqs}
        scheduled, spec = {}, {}
        for req_id in r.sample(list(self.reqs), len(self.reqs)):
            req = self.reqs[req_id]
            left = len(req.tokens) - req.num_computed
            if left == 0 or r.random() < 0.15:
                continue
            n = r.randrange(1, left + 1)
            drafts = [r.randrange(VOCAB) for _ in range(r.choice([0, 0, 2]))] if n == left else []
            scheduled[req_id], spec[req_id] = n + len(drafts), drafts
            need = -(-(req.num_computed + n + len(drafts)) // BS) - len(req.blocks)
            new_blocks = self.blocks(max(0, need))
            table = None
            if req.blocks and r.random() < 0.1:  # copy-on-write of the last block
                req.blocks[-1] = self.blocks(1)[0]
                table = list(req.blocks)
            req.blocks += new_blocks
            appended = [r.randrange(VOCAB)] if req_id not in joined and not drafts and r.random() < 0.1 else []
            req.tokens += appended
            if req_id not in joined:
                running.append(RunningRequestData(req_id=req_id, new_block_ids=[] if table else new_blocks,
                                                  num_computed_tokens=req.num_computed, new_token_ids=appended,
                                                  block_ids=req.blocks if table else None))
        for req_id, req in new_reqs:
            need = -(-(req.num_computed + scheduled.get(req_id, 0)) // BS) - len(req.blocks)
            req.blocks = req.blocks + self.blocks(max(0, need))
        new = [NewRequestData(req_id=i, token_ids=q.tokens, num_prompt_tokens=q.num_prompt, sampling=q.params,
                              block_ids=list(q.blocks), num_computed_tokens=q.num_computed) for i, q in new_reqs]
        return finished, new, running, scheduled, {k: v for k, v in spec.items() if v}


def rebuild(world: World, scheduled, spec):
    """The step's inputs from the requests' lists, as the runner built them before."""
    input_ids, seq_lens, tables, logit_rows, sample_params = [], [], [], [], []
    for req_id, n in scheduled.items():
        req, drafts = world.reqs[req_id], spec.get(req_id, [])
        start, end = req.num_computed, req.num_computed + n - len(drafts)
        input_ids += req.tokens[start:end] + drafts
        seq_lens.append(start + n)
        tables.append(req.blocks)
        if end == len(req.tokens):
            logit_rows += range(len(input_ids) - len(drafts) - 1, len(input_ids))
            if not drafts:
                sample_params.append(column_values(req.params, VOCAB))
    meta = AttentionMetadata.build(list(scheduled.values()), seq_lens, tables, None, BS)
    return input_ids, meta, logit_rows, sample_params


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_the_persistent_batch_equals_a_rebuild_every_step(seed):
    rng = random.Random(seed)
    world = World(rng)
    batch = InputBatch(max_num_reqs=2, vocab_size=VOCAB, block_size=BS, device=torch.device("cpu"))  # rows grow
    limits = PlanLimits(num_blocks=1 << 20, num_host_blocks=0, block_size=BS, max_positions=1 << 10, vocab_size=VOCAB)
    for _ in range(25):
        finished, new, running, scheduled, spec = world.step()
        for req_id in finished:
            batch.remove(req_id)
        # every plan the scheduler's world sends passes the executor's check, on the batch it finds
        check_plan(StepPlan(step_id=0, new_reqs=new, running_reqs=running, num_scheduled_tokens=scheduled,
                            spec_token_ids=spec), limits, batch)
        for n in new:
            batch.add(n.req_id, n.token_ids, n.num_prompt_tokens, n.num_computed_tokens, n.block_ids, n.sampling)
        batch.apply_running(running, 0)
        if not scheduled:
            continue
        step = batch.prepare(scheduled, spec)
        input_ids, meta, logit_rows, sample_params = rebuild(world, scheduled, spec)
        assert step.input_ids.tolist() == input_ids
        for name in ("positions", "slot_mapping", "query_start_loc", "seq_lens"):
            assert getattr(step.meta, name).tolist() == getattr(meta, name).tolist(), name
        assert step.meta.query_lens_list == meta.query_lens_list and step.meta.max_seq_len == meta.max_seq_len
        for b, seq_len in enumerate(meta.seq_lens_list):  # the blocks each sequence reads
            need = -(-seq_len // BS)
            assert step.meta.block_tables[b, :need].tolist() == meta.block_tables[b, :need].tolist()
        assert step.logits_idx.tolist() == logit_rows
        assert step.sample_params.tolist() == torch.tensor(sample_params).reshape(-1, NUM_PARAMS).tolist()
        # the step ran: counts move, samplers without drafts append a token, verifiers their accepted ones
        batch.num_computed[step.rows] += step.counts
        sampled = np.array([rng.randrange(VOCAB) for _ in step.sample_rows], dtype=np.int64)
        batch.append_sampled(step.sample_rows, sampled)
        plain = iter(sampled.tolist())
        for req_id, n in scheduled.items():
            req = world.reqs[req_id]
            req.num_computed += n - len(spec.get(req_id, []))
            if req.num_computed == len(req.tokens):
                if req_id in spec:
                    accepted = spec[req_id][: rng.randrange(len(spec[req_id]) + 1)] + [rng.randrange(VOCAB)]
                    batch.append_tokens(batch.row_of[req_id], accepted)
                    req.tokens += accepted
                else:
                    req.tokens.append(next(plain))
        for req_id, req in world.reqs.items():
            assert batch.tokens(batch.row_of[req_id]).tolist() == req.tokens


def test_a_plan_the_rows_cannot_run_is_a_clear_error():
    batch = InputBatch(max_num_reqs=4, vocab_size=VOCAB, block_size=BS, device=torch.device("cpu"))
    limits = PlanLimits(num_blocks=8, num_host_blocks=0, block_size=BS, max_positions=64, vocab_size=VOCAB)

    def check(num_scheduled, **plan):
        check_plan(StepPlan(step_id=0, num_scheduled_tokens=num_scheduled, **plan), limits, batch)

    batch.add("a", [1, 2, 3], 3, 0, [0], SamplingParams())
    with pytest.raises(InvalidPlan, match="a: 4 tokens scheduled but only 3"):
        check({"a": 4})
    batch.add("b", list(range(9)), 9, 0, [1], SamplingParams())
    with pytest.raises(InvalidPlan, match="b: 9 tokens need more than its 1 blocks"):
        check({"a": 3, "b": 9})
    with pytest.raises(InvalidPlan, match="unknown request 'c'"):
        check({"c": 1})
    check({"a": 3, "b": 9}, running_reqs=[RunningRequestData(req_id="b", new_block_ids=[2, 3], num_computed_tokens=0)])


def test_a_request_takes_the_lowest_free_row():
    """Rows stay a run from 0 while requests come and go together (the sampler reads the penalty
    state of consecutive rows in place)."""
    batch = InputBatch(max_num_reqs=2, vocab_size=VOCAB, block_size=BS, device=torch.device("cpu"))
    params = SamplingParams(temperature=0.0)
    rows = [batch.add(f"r{i}", [1, 2], 2, 0, [i], params) for i in range(5)]  # the rows grow past 2
    assert rows == [0, 1, 2, 3, 4]
    for req_id in ("r3", "r0", "r1"):
        batch.remove(req_id)
    assert [batch.add(f"s{i}", [1], 1, 0, [0], params) for i in range(4)] == [0, 1, 3, 5]

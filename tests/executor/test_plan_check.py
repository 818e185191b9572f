"""Malformed step plans against the runner on both CPU paths: the torch reference (fp32) and the C
kernels (an int4 model, ``--attention-backend cpu``: ``cpu_backend``'s decode stack over
``csrc/layers.c``). Each plan is a well-formed step drawn at random and then broken in one way
(a block, slot, position, token, count, draft, copy or adapter out of range): both paths refuse
it with the same ``InvalidPlan`` before any kernel runs, leave every block of the KV pool and the
persistent batch as they were, and serve the same well-formed plans afterwards as before. The
sanitizer job (``test_sanitizers.py``) runs this file with the C kernels built under
AddressSanitizer, where a stray read or write would be reported."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from folio.core.executor.runtime.plan_check import InvalidPlan
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import KVLoad, NewRequestData, RunningRequestData, StepPlan
from folio.shared.sampling import SamplingParams

NUM_BLOCKS, NUM_HOST_BLOCKS, BS, VOCAB, MAX_POSITIONS = 48, 4, 16, 128, 512  # the tiny model's sizes
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
DRAWN = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.3, seed=11, max_tokens=64, ignore_eos=True)
REQ_IDS = ["a", "b", "c"]
_step_ids = itertools.count()


@pytest.fixture(scope="module")
def runners(tiny_model_dir) -> dict[str, ModelRunner]:
    def runner(**kw) -> ModelRunner:
        return ModelRunner(RuntimeConfig(num_kv_blocks=NUM_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS, block_size=BS,
                                         device="cpu", **kw), tiny_model_dir)

    out = {"torch": runner(), "cpu": runner(quantization="int4", attention_backend="cpu")}
    assert out["torch"].backend.name == "torch" and out["cpu"].backend.name == "cpu"
    assert out["cpu"].limits.max_positions == MAX_POSITIONS and out["cpu"].spec.vocab_size == VOCAB
    return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------- well-formed steps
@st.composite
def steps(draw) -> dict:
    """Requests a and b prefilled by ``setup``; ``step`` decodes both (a block opened where one
    fills) and prefills a new request c, with a copy-on-write pair between free blocks. Plans are
    kept as keyword dicts so that a breach can edit them."""
    tokens = lambda n: draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))  # noqa: E731
    la, lb, lc = (draw(st.integers(1, 3 * BS)) for _ in range(3))
    order = iter(draw(st.permutations(range(NUM_BLOCKS))))  # block ids in the order handed out
    take = lambda n: [next(order) for _ in range(n)]  # noqa: E731
    a = dict(req_id="a", token_ids=tokens(la), num_prompt_tokens=la, sampling=GREEDY, block_ids=take(cdiv(la, BS)))
    b = dict(req_id="b", token_ids=tokens(lb), num_prompt_tokens=lb, sampling=DRAWN, block_ids=take(cdiv(lb, BS)))
    c = dict(req_id="c", token_ids=tokens(lc), num_prompt_tokens=lc, sampling=DRAWN, block_ids=take(cdiv(lc, BS)))
    running = [dict(req_id=r["req_id"], new_block_ids=take(1), num_computed_tokens=len(r["token_ids"]))
               for r in (a, b) if len(r["token_ids"]) % BS == 0]  # the sampled token opens a block
    setup = dict(new_reqs=[a, b], num_scheduled_tokens={"a": la, "b": lb})
    step = dict(new_reqs=[c], running_reqs=running, num_scheduled_tokens={"a": 1, "b": 1, "c": lc},
                block_copies=[tuple(take(2))])
    return {"setup": setup, "step": step, "free": take(4), "lens": (la, lb, lc)}


def plan(fields: dict, **more) -> StepPlan:
    return StepPlan(step_id=next(_step_ids),
                    new_reqs=[NewRequestData(**r) for r in fields.get("new_reqs", ())],
                    running_reqs=[RunningRequestData(**r) for r in fields.get("running_reqs", ())],
                    **{k: v for k, v in fields.items() if k not in ("new_reqs", "running_reqs")}, **more)


# ---------------------------------------------------------------------- breaches
OUT_OF_POOL = st.one_of(st.integers(NUM_BLOCKS, NUM_BLOCKS + 10**6), st.integers(-10**6, -1),
                        st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]))
OUT_OF_HOST = st.one_of(st.integers(NUM_HOST_BLOCKS, 10**6), st.integers(-10**6, -1))
OUT_OF_VOCAB = st.one_of(st.integers(VOCAB, VOCAB + 10**6), st.integers(-10**6, -1), st.sampled_from([2**63, 2**64 - 1]))
BAD_COUNT = st.one_of(st.integers(-10**6, 0), st.integers(2, 10**6), st.sampled_from([2**63 - 1, 2**64 - 1]))


def _running(step: dict, req_id: str, num_computed: int) -> dict:
    """``req_id``'s running diff in ``step``, made if it has none."""
    for r in step["running_reqs"]:
        if r["req_id"] == req_id:
            return r
    r = dict(req_id=req_id, new_block_ids=[], num_computed_tokens=num_computed)
    step["running_reqs"].append(r)
    return r


def _replace_one(draw, ids: list, value) -> list:
    ids = list(ids)
    ids[draw(st.integers(0, len(ids) - 1))] = value
    return ids


@st.composite
def breaches(draw, kind: str) -> tuple[dict, dict]:
    """A well-formed scenario and its step broken in the way ``kind`` names: (scenario, broken step)."""
    sc = draw(steps())
    step, (la, lb, lc) = copy.deepcopy(sc["step"]), sc["lens"]
    c = step["new_reqs"][0]
    if kind == "block of a new request":
        c["block_ids"] = _replace_one(draw, c["block_ids"], draw(OUT_OF_POOL))
    elif kind == "block a running request gains":
        _running(step, "a", la)["new_block_ids"] = [draw(OUT_OF_POOL)]
    elif kind == "block of a copied-on-write table":
        r = _running(step, "a", la)
        r["block_ids"], r["new_block_ids"] = _replace_one(draw, sc["setup"]["new_reqs"][0]["block_ids"],
                                                          draw(OUT_OF_POOL)), []
    elif kind == "copy-on-write pair":
        step["block_copies"] = [tuple(_replace_one(draw, step["block_copies"][0], draw(OUT_OF_POOL)))]
    elif kind == "swap-out pair":
        step["swap_out"] = [draw(st.sampled_from([(sc["free"][0], draw(OUT_OF_HOST)), (draw(OUT_OF_POOL), 0)]))]
    elif kind == "swap-in pair":
        step["swap_in"] = [draw(st.sampled_from([(draw(OUT_OF_HOST), sc["free"][0]), (0, draw(OUT_OF_POOL))]))]
    elif kind == "disk-tier load without a disk tier":
        step["tier_loads"] = [(sc["free"][0], b"\0" * 16)]
    elif kind == "block of a KV pull":
        step["kv_loads"] = [KVLoad(req_id="c", handle={}, block_ids=[draw(OUT_OF_POOL.filter(lambda b: b != -1))])]
    elif kind == "token of a new request":
        c["token_ids"] = _replace_one(draw, c["token_ids"], draw(OUT_OF_VOCAB))
    elif kind == "token the scheduler appends":
        _running(step, "a", la)["new_token_ids"] = [draw(OUT_OF_VOCAB)]
        step["num_scheduled_tokens"]["a"] = 2
    elif kind == "draft token":
        step["spec_token_ids"] = {"a": [draw(OUT_OF_VOCAB)]}
        step["num_scheduled_tokens"]["a"] = 2
    elif kind == "drafts filling the chunk":
        step["spec_token_ids"] = {"a": [1] * draw(st.integers(1, 4))}
    elif kind == "drafts of a request not scheduled":
        step["spec_token_ids"] = {draw(st.sampled_from(["zz", "d"])): [1]}
    elif kind == "unknown request scheduled":
        step["num_scheduled_tokens"][draw(st.sampled_from(["zz", "c2", ""]))] = 1
    elif kind == "unknown running request":
        step["running_reqs"].append(dict(req_id="zz", new_block_ids=[], num_computed_tokens=0))
    elif kind == "count":
        step["num_scheduled_tokens"][draw(st.sampled_from(["a", "b", "c"]))] = draw(BAD_COUNT)
    elif kind == "computed tokens of a running request":
        _running(step, "a", la)["num_computed_tokens"] = draw(st.one_of(
            st.integers(-10**6, -1), st.integers(la + 1, la + 10**6), st.sampled_from([2**63 - 1, 2**64 - 1])))
    elif kind == "computed tokens of a new request":
        c["num_computed_tokens"] = draw(st.integers(lc + 1, lc + 10**6) | st.integers(-10**6, -1))
    elif kind == "prompt longer than the tokens":
        c["num_prompt_tokens"] = lc + draw(st.integers(1, 10**6))
    elif kind == "block table too short":
        if len(c["block_ids"]) == 1:
            c["token_ids"] = c["token_ids"] * BS + [1]  # one block too few for the whole prompt
            c["num_prompt_tokens"] = len(c["token_ids"])
            step["num_scheduled_tokens"]["c"] = len(c["token_ids"])
        else:
            c["block_ids"] = c["block_ids"][:-1]
    elif kind == "position beyond the RoPE tables":
        n = MAX_POSITIONS + draw(st.integers(1, 40))
        c.update(token_ids=[1] * n, num_prompt_tokens=n, num_computed_tokens=n - BS, block_ids=sc["free"][:1] * cdiv(n, BS))
        step["num_scheduled_tokens"]["c"] = BS
    elif kind == "LoRA adapter without LoRA":
        c["lora_name"] = "sql"
    elif kind == "request named twice":
        step["running_reqs"] += [dict(req_id="b", new_block_ids=[], num_computed_tokens=lb)] * 2
    else:
        raise AssertionError(f"no breach {kind!r}")
    return sc, step


BREACHES = ["block of a new request", "block a running request gains", "block of a copied-on-write table",
            "copy-on-write pair", "swap-out pair", "swap-in pair", "disk-tier load without a disk tier",
            "block of a KV pull", "token of a new request", "token the scheduler appends", "draft token",
            "drafts filling the chunk", "drafts of a request not scheduled", "unknown request scheduled",
            "unknown running request", "count", "computed tokens of a running request",
            "computed tokens of a new request", "prompt longer than the tokens", "block table too short",
            "position beyond the RoPE tables", "LoRA adapter without LoRA", "request named twice"]


# ---------------------------------------------------------------------- the property
def snapshot(runner: ModelRunner) -> dict:
    batch = runner.batch
    return {"pool": [t.clone() for kv in runner.pool.kv_caches for t in kv],
            "host": [t.clone() for kv in runner.pool.host_caches for t in kv],
            "rows": dict(batch.row_of), "requests": sorted(runner.requests),
            **{name: getattr(batch, name).copy() for name in ("token_ids", "num_tokens", "num_prompt", "num_computed",
                                                               "block_table", "num_blocks", "params", "lora_ids")}}


def assert_unchanged(before: dict, after: dict) -> None:
    for name, old in before.items():
        new = after[name]
        if isinstance(old, list) and old and isinstance(old[0], torch.Tensor):
            assert all(torch.equal(x, y) for x, y in zip(old, new)), f"the refused plan wrote into the {name}"
        elif isinstance(old, np.ndarray):
            assert np.array_equal(old, new), name
        else:
            assert old == new, name


def finish(runner: ModelRunner) -> None:
    runner.execute(StepPlan(step_id=next(_step_ids), finished_req_ids=REQ_IDS))


def run_clean(runner: ModelRunner, sc: dict) -> tuple:
    try:
        first = runner.execute(plan(sc["setup"]))
        second = runner.execute(plan(sc["step"]))
    finally:
        finish(runner)
    assert second.req_ids == ["a", "b", "c"] and len(second.token_ids) == 3
    return first.token_ids, second.token_ids


def run_refused(runner: ModelRunner, sc: dict, bad: StepPlan) -> str:
    """The setup, the broken step (refused, nothing changed), the scheduler's end of its
    requests; returns the refusal."""
    try:
        runner.execute(plan(sc["setup"]))
        before = snapshot(runner)
        with pytest.raises(InvalidPlan) as refused:
            runner.execute(bad)
        assert_unchanged(before, snapshot(runner))
        # a plan made ahead still naming them runs without them (the scheduler ended them)
        ahead = runner.execute(StepPlan(step_id=next(_step_ids), num_scheduled_tokens={"a": 1}))
        assert ahead.req_ids == [] and runner.batch.num_computed[runner.batch.row_of["a"]] == sc["lens"][0]
    finally:
        finish(runner)
    assert runner.requests == {} and runner.batch.row_of == {} and not runner._refused
    return str(refused.value)


@pytest.mark.parametrize("kind", BREACHES)
@given(data=st.data())
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_a_broken_plan_is_refused_on_both_paths_before_any_kernel_runs(runners, kind, data):
    sc, broken = data.draw(breaches(kind))
    note(f"{kind}: {broken}")
    refusals, bad = {}, plan(broken)
    for name, runner in runners.items():
        clean = run_clean(runner, sc)
        refusals[name] = run_refused(runner, sc, bad)
        assert run_clean(runner, sc) == clean, f"{name}: the refusal changed what later plans compute"
    assert refusals["torch"] == refusals["cpu"], kind


@given(steps())
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_well_formed_plans_drawn_alike_run_on_both_paths(runners, sc):
    for runner in runners.values():
        run_clean(runner, sc)


def test_each_breach_names_the_request_and_the_value(runners):
    runner = runners["cpu"]
    sc = {"setup": dict(new_reqs=[dict(req_id="a", token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=GREEDY,
                                       block_ids=[5])], num_scheduled_tokens={"a": 3})}
    cases = {
        "c: block id 48 is outside the pool (0..47)":
            dict(new_reqs=[dict(req_id="c", token_ids=[1], num_prompt_tokens=1, sampling=GREEDY, block_ids=[48])],
                 num_scheduled_tokens={"c": 1}),
        "a: token id 128 is outside the vocabulary (0..127)":
            dict(running_reqs=[dict(req_id="a", new_block_ids=[], num_computed_tokens=3, new_token_ids=[128])],
                 num_scheduled_tokens={"a": 2}),
        "a: position 512 is outside the RoPE tables (0..511)":
            dict(new_reqs=[dict(req_id="a", token_ids=[1] * 513, num_prompt_tokens=513, sampling=GREEDY,
                                num_computed_tokens=512, block_ids=[0] * 33)], num_scheduled_tokens={"a": 1},
                 finished_req_ids=["a"]),
        "block_copies[0] = (3, 99): block 99 is outside the device pool (0..47)": dict(block_copies=[(3, 99)]),
        "swap_out[0] = (3, 4): block 4 is outside the host tier (0..3)": dict(swap_out=[(3, 4)]),
        "a: 2 tokens scheduled but only 1 to compute": dict(num_scheduled_tokens={"a": 2}),
    }
    for message, fields in cases.items():
        try:
            runner.execute(plan(sc["setup"]))
            with pytest.raises(InvalidPlan) as refused:
                runner.execute(plan(fields))
            assert str(refused.value) == message
        finally:
            finish(runner)

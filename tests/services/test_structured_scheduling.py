"""A request samples only once its grammar is compiled (``folio/core/structured/scheduling.py``): the scheduler
holds back the token it samples from until a step result names its grammar ready, asks for each
new grammar once, holds nothing back for a grammar the executor reported compiled, ends the
requests of a grammar that failed to compile with the reason, and forgets what it knew when the
executor restarts (a new epoch). Real scheduler, allocator and runner (``LocalEngine``) or real
services over ipc:// (``back_half``)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from folio.shared.messages import GuidedSpec  # noqa: E402
from folio.shared.sampling import SamplingParams  # noqa: E402
from folio.services.in_process import back_half  # noqa: E402
from tests.core.engine import LocalEngine, engine_request, make_runner  # noqa: E402
from tests.services.test_structured_compile import new_wide_schema  # noqa: E402
from tests.core.structured.test_structured_engine import chat_model, grammars, tok  # noqa: E402,F401  (fixtures)

CODE = r"[0-9]{3}-[a-z]{2,5}"


def _first_plan_of(engine: LocalEngine, req_id: str):
    return next(p for p in engine.plans if req_id in p.num_scheduled_tokens)


def test_the_sampling_token_waits_for_a_new_grammar_and_a_known_one_costs_no_step(chat_model, tok, grammars):  # noqa: F811
    runner = make_runner(chat_model, num_kv_blocks=64, block_size=16)
    engine = LocalEngine(runner, max_num_seqs=8, max_num_batched_tokens=64)
    grammar = grammars.check(GuidedSpec(kind="regex", spec=CODE))
    prompt = tok.hf.encode("Give a code in the usual form, please:")
    engine.add(engine_request("a", prompt, max_tokens=16, eos_token_id=tok.eos_token_id, grammar=grammar))
    engine.add(engine_request("plain", tok.hf.encode("Story:"), max_tokens=40, ignore_eos=True))
    engine.run()
    first = _first_plan_of(engine, "a")
    # asked for once, with everything but the token it samples from
    assert [g.key for g in first.grammars] == [grammar.key] and first.num_scheduled_tokens["a"] == len(prompt) - 1
    assert sum(g.key == grammar.key for p in engine.plans for g in p.grammars) == 1
    assert re.fullmatch(CODE, tok.decode(engine.outputs["a"].token_ids)), engine.outputs["a"]
    stats = runner.stats()
    assert stats["grammar_wait_seconds_total"] == 0.0 and stats["num_grammar_compiles"] == 1
    assert engine.sched.counters["num_grammar_held_steps"] >= 1
    # the same grammar again: cached in the executor and known to be: the whole prompt at once
    n = len(engine.plans)
    engine.add(engine_request("b", prompt, max_tokens=16, eos_token_id=tok.eos_token_id, grammar=grammar,
                              temperature=1.0, seed=1))
    engine.run()
    first = _first_plan_of(engine, "b")
    assert first is engine.plans[n] and not first.grammars and not any(p.grammars for p in engine.plans[n:])
    assert first.num_scheduled_tokens["b"] == len(prompt)  # and it sampled in that very step
    assert re.fullmatch(CODE, tok.decode(engine.outputs["b"].token_ids))
    assert runner.stats()["num_grammar_compiles"] == 1 and runner.stats()["num_grammar_cache_hits"] == 1


def test_n3_forks_abort_and_an_evicted_grammar(chat_model, tok, grammars):  # noqa: F811
    runner = make_runner(chat_model, num_kv_blocks=64, block_size=16)
    engine = LocalEngine(runner, max_num_seqs=8, max_num_batched_tokens=64)
    grammar = grammars.check(GuidedSpec(kind="regex", spec=CODE + "!"))
    prompt = tok.hf.encode("Codes:")
    # aborted while its grammar compiles: nothing hangs, and the compile serves the next request
    engine.add(engine_request("gone", prompt, max_tokens=16, eos_token_id=tok.eos_token_id, grammar=grammar))
    engine.step()
    assert engine.abort("gone")
    engine.run()
    assert not engine.has_work()
    engine.add(engine_request("n3", prompt, max_tokens=16, eos_token_id=tok.eos_token_id, grammar=grammar,
                              temperature=1.0, seed=5, fork_req_ids=["n3-1", "n3-2"]))
    outputs = engine.run()
    for req_id in ("n3", "n3-1", "n3-2"):
        assert outputs[req_id].finish_reason == "stop"
        assert re.fullmatch(CODE + "!", tok.decode(outputs[req_id].token_ids)), outputs[req_id]
    assert runner.stats()["num_grammar_compiles"] == 1
    # the executor dropped it since (its LRU): the request's first sample waits for a new compile
    runner.grammars._compiled.clear()
    engine.add(engine_request("again", prompt, max_tokens=16, eos_token_id=tok.eos_token_id, grammar=grammar))
    out = engine.run()["again"]
    assert re.fullmatch(CODE + "!", tok.decode(out.token_ids)) and runner.stats()["num_grammar_compiles"] == 2


def test_a_grammar_the_executor_cannot_compile_ends_its_requests_with_the_reason(chat_model, tok, grammars):  # noqa: F811
    runner = make_runner(chat_model, num_kv_blocks=64, block_size=16)
    engine = LocalEngine(runner, max_num_seqs=8, max_num_batched_tokens=64)
    bad = grammars.check(GuidedSpec(kind="regex", spec="[xyz]{4}"))
    good = grammars.check(GuidedSpec(kind="regex", spec=CODE))
    compile_ = runner.grammars._compile

    def failing(grammar):
        if grammar.key == bad.key:
            raise RuntimeError("[12:00:00] /src/compiler.cc:42: out of memory")
        return compile_(grammar)

    runner.grammars._compile = failing
    prompt = tok.hf.encode("Go:")
    engine.add(engine_request("bad", prompt, max_tokens=8, grammar=bad, fork_req_ids=["bad-1"]))
    engine.add(engine_request("good", prompt, max_tokens=16, eos_token_id=tok.eos_token_id, grammar=good))
    engine.add(engine_request("plain", prompt, max_tokens=12, ignore_eos=True))
    outputs = engine.run()
    for req_id in ("bad", "bad-1"):
        out = outputs[req_id]
        assert out.finish_reason == "error" and not out.token_ids
        assert out.error == "the executor could not compile the request's grammar: out of memory", out.error
    assert re.fullmatch(CODE, tok.decode(outputs["good"].token_ids))
    assert outputs["plain"].finish_reason == "length" and len(outputs["plain"].token_ids) == 12
    assert engine.sched.counters["num_grammar_errors"] == 2 and not engine.has_work()


@pytest.mark.slow  # over 8 s: the full suite only
@pytest.mark.asyncio
async def test_an_executor_restart_while_a_grammar_compiles(chat_model, tok):  # noqa: F811
    """The new executor has compiled nothing: the scheduler asks it again (a scheduler that kept
    waiting for the old executor's answer would hold the request forever)."""
    from folio.core.structured.grammar import check_spec

    async with back_half(chat_model, num_kv_blocks=64, block_size=16, max_num_seqs=4,
                         max_num_batched_tokens=64) as bh:
        schema = new_wide_schema(1500)
        grammar = await asyncio.to_thread(check_spec, GuidedSpec(kind="json_schema", spec=json.dumps(schema)))
        await bh.submit("r", tok.hf.encode("JSON:"), SamplingParams(temperature=0.0, max_tokens=100),
                        tok.eos_token_id, grammar=grammar)
        collected = asyncio.ensure_future(bh.collect(["r"], timeout_s=120))
        for _ in range(2000):  # until the scheduler asked for the grammar
            if (await bh.admin("scheduler", "stats")).data["num_grammar_held_steps"]:
                break
            await asyncio.sleep(0.01)
        await bh.restart_executor()
        tokens, reason = (await collected)["r"]
        assert reason == "stop"
        jsonschema.validate(json.loads(tok.decode(tokens)), schema)
        assert (await bh.admin("scheduler", "stats")).data["num_epochs"] == 2  # the start, the restart
        # the new executor was asked for the grammar and compiled it before the request sampled
        # (a scheduler that still took it for ready would have made the step wait for the compile)
        stats = (await bh.admin("executor", "stats")).data
        assert stats["num_grammar_compiles"] == 1 and stats["grammar_wait_seconds_total"] == 0.0

"""Where grammars compile and what that costs the others: the tokenizer checks a spec once
however many requests bring it (and answers a bad one with a 400 naming the field, while the
service keeps serving); the executor compiles a large schema in its worker thread while the
steps go on, and the step gaps of the other requests stay at their usual size, even when the new
schema comes with a prompt of a few tokens (the scheduler holds its first sample back until the
executor reports the grammar compiled)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections import defaultdict

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from folio.core.structured.grammar import GrammarChecker, GrammarError, check_spec  # noqa: E402
from folio.shared.messages import AbortRequest, GuidedSpec, TokenBatch, SamplingParams  # noqa: E402
from folio.shared.sampling import SamplingParams
from folio.shared.transport import Decoder, encode  # noqa: E402
from folio.services.in_process import back_half  # noqa: E402
from tests.core.engine import LocalEngine, engine_request, make_runner  # noqa: E402
from tests.core.structured.test_structured_engine import chat_model, tok  # noqa: E402,F401  (fixtures)


def large_schema(num_fields: int) -> dict:
    fields = {f"field_{i}": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}[0-9]{{1,3}}$"},
        "b": {"enum": [f"v{i}_{k}" for k in range(8)]},
        "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": i + 10}, "maxItems": 3}}}
        for i in range(num_fields)}
    return {"type": "object", "properties": fields, "required": list(fields)[:3], "additionalProperties": False}


def new_wide_schema(num_fields: int) -> dict:
    """``large_schema`` under field names no earlier schema used, whose instances hold one field:
    its compile takes as long as the whole schema's, its outputs are short."""
    tag = uuid.uuid4().hex[:8]
    schema = large_schema(num_fields)
    schema["properties"] = {f"{tag}_{name}": field for name, field in schema["properties"].items()}
    schema["required"], schema["maxProperties"] = [f"{tag}_field_0"], 1
    return schema


def test_checker_checks_each_spec_once_and_names_bad_ones():
    checker = GrammarChecker()
    try:
        spec = GuidedSpec(kind="json_schema", spec=json.dumps(large_schema(5)), param="guided_json")
        futures = [checker.submit(spec) for _ in range(4)]  # a burst of one new schema
        grammars = {f.result().key for f in futures}
        assert len(grammars) == 1 and checker.lookup(spec) is not None
        assert checker.stats["num_grammar_checks"] == 1 and checker.stats["num_grammar_check_hits"] == 4
        for bad, param, words in [
            (GuidedSpec(kind="json_schema", spec='{"type": "nope"}'), "response_format", "Unsupported type"),
            (GuidedSpec(kind="json_schema", spec='{"type": ', param="guided_json"), "guided_json", "not valid JSON"),
            (GuidedSpec(kind="regex", spec="(ab", param="guided_regex"), "guided_regex", "parenthesis"),
            (GuidedSpec(kind="grammar", spec="root ::= nope", param="guided_grammar"), "guided_grammar", "nope"),
        ]:
            with pytest.raises(GrammarError) as err:
                checker.check(bad)
            assert err.value.param == param and words in str(err.value) and "/project/" not in str(err.value)
        assert checker.stats["num_grammar_errors"] == 4
    finally:
        checker.close()


def test_a_large_schema_compiles_beside_the_steps(chat_model, tok):  # noqa: F811
    runner = make_runner(chat_model, num_kv_blocks=128, block_size=16)
    runner.grammars.prepare(check_spec(GuidedSpec(kind="regex", spec="a"))).result()  # the vocabulary, loaded
    warm_s = runner.grammars.stats["grammar_compile_seconds_total"]
    engine = LocalEngine(runner, max_num_seqs=16, max_num_batched_tokens=24)
    for i in range(4):
        engine.add(engine_request(f"plain-{i}", tok.hf.encode(f"Story {i}:"), max_tokens=60, ignore_eos=True))
    gaps = []
    for _ in range(10):  # the usual step
        t0 = time.perf_counter()
        engine.step()
        gaps.append(time.perf_counter() - t0)
    usual = statistics.median(gaps)
    # its long prompt is computed in chunks (the token budget): the compile runs meanwhile
    grammar = check_spec(GuidedSpec(kind="json_schema", spec=json.dumps(large_schema(150))))
    prompt = tok.hf.encode("Fill in the form. " * 60)  # ~300 tokens: a dozen chunked steps
    engine.add(engine_request("big", prompt, max_tokens=30, eos_token_id=tok.eos_token_id, grammar=grammar))
    during = []
    while runner.grammars.stats["num_grammar_compiles"] == 1 or not engine.outputs["big"].token_ids:
        t0 = time.perf_counter()
        engine.step()
        during.append(time.perf_counter() - t0)
    compile_s = runner.grammars.stats["grammar_compile_seconds_total"] - warm_s
    assert runner.grammars.stats["num_grammar_compiles"] == 2  # the warm-up's, then the schema's, once
    # the compile overlapped the steps: its request waited for at most a part of it at its first
    # sample (a blocking compile waits for all of it); a quiet machine compiles this in ~30 ms
    assert runner.grammars.stats["grammar_wait_seconds_total"] < 0.5 * compile_s, runner.grammars.stats
    # the steps around the compile kept their pace (a stalled loop would show the compile's length)
    assert max(during) < max(4 * usual, usual + 0.5 * compile_s), (usual, during, compile_s)
    engine.run()
    assert engine.outputs["big"].token_ids and all(engine.outputs[f"plain-{i}"].finish_reason for i in range(4))


async def _until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_new_schema_with_a_short_prompt_never_stalls_the_others(chat_model, tok):  # noqa: F811
    """Real services (kvmanager, executor, scheduler over ipc://): greedy streams decode while a
    request with a two-token prompt brings a large schema nobody compiled before. Its whole prompt
    fits one step, so a step that had to wait for the compile would stall every stream for about
    the compile's length; the streams' gaps stay far below it, and no step waited."""
    async with back_half(chat_model, num_kv_blocks=256, block_size=16, max_num_seqs=8,
                         max_num_batched_tokens=64) as bh:
        arrivals: dict[str, list[float]] = defaultdict(list)
        tokens: dict[str, list[int]] = defaultdict(list)
        finished: dict[str, tuple[str, str | None]] = {}

        async def read():
            decoder = Decoder(TokenBatch)
            while True:
                batch = decoder.decode(await bh.from_scheduler.recv())
                now = time.perf_counter()
                for d in batch.all_deltas():
                    if d.token_ids:
                        arrivals[d.req_id].append(now)
                        tokens[d.req_id].extend(d.token_ids)
                    if d.finish_reason is not None:
                        finished[d.req_id] = (d.finish_reason, d.error)

        reader = asyncio.ensure_future(read())
        try:
            eos = tok.eos_token_id
            warm = check_spec(GuidedSpec(kind="regex", spec="[0-9]{2}"))  # the vocabulary, loaded
            await bh.submit("warm", tok.hf.encode("Number:"), SamplingParams(temperature=0.0, max_tokens=4), eos,
                            grammar=warm)
            await _until(lambda: "warm" in finished, 300, "the warm-up request")
            assert finished["warm"][0] == "stop", finished["warm"]
            schema = new_wide_schema(2000)
            # (checked off the loop, which the scheduler shares: the check builds the whole grammar; before the
            # streams start, so that they have all their tokens left to decode through the executor's compile)
            grammar = await asyncio.to_thread(check_spec, GuidedSpec(kind="json_schema", spec=json.dumps(schema)))
            streams = [f"plain-{i}" for i in range(3)]
            for i, req_id in enumerate(streams):
                await bh.submit(req_id, tok.hf.encode(f"Story {i}:"),
                                SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True))
            await _until(lambda: all(len(tokens[r]) >= 8 for r in streams), 300, "the streams to decode")
            before = (await bh.admin("executor", "stats")).data
            sent = time.perf_counter()
            await bh.submit("big", tok.hf.encode("JSON:"), SamplingParams(temperature=0.0, max_tokens=200), eos,
                            grammar=grammar)
            await _until(lambda: "big" in finished, 300, "the constrained request")
            first = arrivals["big"][0]
            after = (await bh.admin("executor", "stats")).data
            sched = (await bh.admin("scheduler", "stats")).data
            for req_id in streams:
                await bh.to_scheduler.send(encode(AbortRequest(req_id=req_id, reason="test over")))
        finally:
            reader.cancel()
        compile_s = after["grammar_compile_seconds_total"] - before["grammar_compile_seconds_total"]
        assert after["num_grammar_compiles"] == before["num_grammar_compiles"] + 1
        reason, error = finished["big"]
        assert reason == "stop", (reason, error)
        jsonschema.validate(json.loads(tok.decode(tokens["big"])), schema)
        # the streams were decoding all along: through the compile and past the first token
        assert all(arrivals[r][-1] > first for r in streams), "a stream ended before the compile did"
        usual = statistics.median(b - a for r in streams for a, b in zip(arrivals[r], arrivals[r][1:]) if b < sent)
        during = [b - a for r in streams for a, b in zip(arrivals[r], arrivals[r][1:]) if b > sent and a < first]
        assert compile_s > 8 * usual, f"the compile ({compile_s:.3f} s) is too short to tell a stall from a step"
        # a step that waited for the compile would show a gap of nearly its length
        print(f"compile {compile_s:.3f} s, usual gap {usual:.3f} s, longest gap meanwhile {max(during):.3f} s")
        assert max(during) < 0.4 * compile_s, (max(during), compile_s, usual)
        assert after["grammar_wait_seconds_total"] == before["grammar_wait_seconds_total"]
        assert sched["num_grammar_held_steps"] > 0

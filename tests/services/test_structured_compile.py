"""Where grammars compile and what that costs the others: the tokenizer checks a spec once
however many requests bring it (and answers a bad one with a 400 naming the field, while the
service keeps serving); the executor compiles a large schema in its worker thread while the
steps go on, and the step gaps of the other requests stay at their usual size."""

from __future__ import annotations

import json
import statistics
import time

import pytest

pytest.importorskip("xgrammar")

from folio.shared.grammar import GrammarChecker, GrammarError, check_spec  # noqa: E402
from folio.shared.messages import GuidedSpec  # noqa: E402
from tests.services.engine import LocalEngine, engine_request, make_runner  # noqa: E402
from tests.services.test_structured_engine import chat_model, tok  # noqa: E402,F401  (fixtures)


def large_schema(num_fields: int) -> dict:
    fields = {f"field_{i}": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}[0-9]{{1,3}}$"},
        "b": {"enum": [f"v{i}_{k}" for k in range(8)]},
        "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": i + 10}, "maxItems": 3}}}
        for i in range(num_fields)}
    return {"type": "object", "properties": fields, "required": list(fields)[:3], "additionalProperties": False}


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

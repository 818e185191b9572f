"""Structured output through the real scheduler, allocator and runner (``LocalEngine``): every
output of 32 schemas parses and validates, greedy and sampled, with n = 3 (forks, each with its
own matcher) and a KV pool small enough that requests are preempted and recomputed (the matcher
replays the tokens it had). The model is a random-weight Llama with SmolLM2's tokenizer: left to
itself it writes noise, so whatever parses was the grammar's doing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from folio.core.structured.grammar import GrammarChecker  # noqa: E402
from folio.shared.messages import GuidedSpec  # noqa: E402
from tests.core.engine import LocalEngine, engine_request, make_runner  # noqa: E402
from tests.services.frontend import text_tokenizer  # noqa: E402
from tests.core.structured.structured_schemas import SCHEMAS  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return text_tokenizer()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, tok):
    from folio.testing.models import write_tiny_model

    folder = tmp_path_factory.mktemp("tiny-chat")
    write_tiny_model(folder, vocab_size=49152, max_position_embeddings=512)
    for f in Path(tok.hf.name_or_path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return str(folder)


@pytest.fixture(scope="module")
def grammars():
    checker = GrammarChecker()
    yield checker
    checker.close()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_every_output_validates_greedy_and_sampled_n3_under_preemption(chat_model, tok, grammars, async_scheduling):
    runner = make_runner(chat_model, num_kv_blocks=48, block_size=16)
    engine = LocalEngine(runner, max_num_seqs=48, max_num_batched_tokens=512, async_scheduling=async_scheduling)
    prompt = tok.hf.encode("Answer in JSON:")
    expected = {}
    for i, schema in enumerate(SCHEMAS):
        grammar = grammars.check(GuidedSpec(kind="json_schema", spec=json.dumps(schema)))
        for mode, options in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 1.0, "seed": i})):
            req_id = f"s{i}-{mode}"
            forks = [f"{req_id}-{k}" for k in (1, 2)]
            engine.add(engine_request(req_id, prompt, max_tokens=200, eos_token_id=tok.eos_token_id,
                                      grammar=grammar, fork_req_ids=forks, **options))
            for r in (req_id, *forks):
                expected[r] = schema
    outputs = engine.run()
    assert engine.sched.counters["num_preemptions"] > 0  # the small pool forced recomputes
    # one compile per schema, however many choices, recomputes and forks use it
    assert runner.stats()["num_grammar_compiles"] == len(SCHEMAS)
    distinct = set()
    for req_id, schema in expected.items():
        out = outputs[req_id]
        assert out.finish_reason == "stop", (req_id, out)
        text = tok.decode(out.token_ids)
        jsonschema.validate(json.loads(text), schema)
        distinct.add(text)
    assert len(distinct) > len(SCHEMAS) * 2  # sampled forks differ: the masks did not collapse them
    stats = runner.stats()
    assert stats["num_constrained_rows"] >= sum(len(o.token_ids) for o in outputs.values())


def test_max_tokens_mid_structure_finishes_with_length(chat_model, tok, grammars):
    runner = make_runner(chat_model, num_kv_blocks=16, block_size=16)
    engine = LocalEngine(runner)
    grammar = grammars.check(GuidedSpec(kind="json_schema", spec=json.dumps(SCHEMAS[14])))
    engine.add(engine_request("r", tok.hf.encode("JSON:"), max_tokens=4, eos_token_id=tok.eos_token_id,
                              grammar=grammar))
    out = engine.run()["r"]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    text = tok.decode(out.token_ids)
    assert '{"people":[{"name":"'.startswith(text)  # cut inside the structure the grammar forced


WORDS = "( the| on| cat| sat)+"  # the prompt's words but " mat"
WORDS16 = "( the| on| cat| sat){16}"


def test_a_constrained_rows_drafts_stop_where_its_grammar_refuses_one(chat_model, tok, grammars):
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.messages import NewRequestData, StepPlan
    from folio.shared.sampling import SamplingParams

    config = RuntimeConfig(num_kv_blocks=16, block_size=16, device="cpu", dtype="float32",
                           speculative_model="ngram", num_speculative_tokens=3)
    runner = ModelRunner(config, chat_model)
    grammar = grammars.check(GuidedSpec(kind="regex", spec=WORDS))
    prompt = tok.hf.encode("the cat sat on the mat the cat sat on the mat the cat sat")
    reqs = [NewRequestData(req_id=r, token_ids=prompt, num_prompt_tokens=len(prompt), block_ids=[i * 4 + j for j in range(4)],
                           sampling=SamplingParams(temperature=0.0, max_tokens=8), grammar=g)
            for i, (r, g) in enumerate((("plain", None), ("constrained", grammar)))]
    runner.execute(StepPlan(step_id=0, new_reqs=reqs, num_scheduled_tokens={r.req_id: len(prompt) for r in reqs}))
    states = [runner.requests["plain"], runner.requests["constrained"]]
    for state in states:  # the random model's token replaced by " on", which the prompt follows with " the mat"
        runner.batch.token_ids[state.row, runner.batch.num_tokens[state.row] - 1] = prompt[3]
    states[1].matcher = runner.grammars.matcher(grammar, [])  # the grammar at its start
    plain, constrained = runner._propose(states)
    words = [tok.decode([t]) for t in plain]
    keep = next(i for i, w in enumerate(words) if w not in (" the", " on", " cat", " sat"))
    assert 0 < keep < len(plain) and words[keep] == " mat"
    assert constrained == plain[:keep]  # cut before the draft the grammar refuses


def test_speculation_on_constrained_rows_keeps_the_greedy_output(chat_model, tok, grammars):
    """Constrained requests draft (cut by their grammar) and verify under their masks: the tokens
    are plain constrained decoding's, and every output matches the grammar."""
    import re

    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig

    grammar = grammars.check(GuidedSpec(kind="regex", spec=WORDS16))
    prompt = tok.hf.encode("the cat sat on the mat the cat sat on the mat the cat sat on the")
    outputs, counters = {}, {}
    for spec in ({}, dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}')):
        runner = ModelRunner(RuntimeConfig(num_kv_blocks=32, block_size=16, device="cpu", dtype="float32", **spec),
                             chat_model)
        engine = LocalEngine(runner)
        for i in range(2):
            engine.add(engine_request(f"r{i}", prompt + prompt[: i + 1], max_tokens=80, eos_token_id=tok.eos_token_id,
                                      grammar=grammar))
        outputs[bool(spec)] = {r: o.token_ids for r, o in engine.run().items()}
        counters[bool(spec)] = engine.sched.counters
    assert outputs[True] == outputs[False]
    assert counters[True]["num_spec_accepted_tokens"] > 0
    for tokens in outputs[True].values():
        assert re.fullmatch(WORDS16, tok.decode(tokens[:-1])) and tokens[-1] == tok.eos_token_id

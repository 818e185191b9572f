"""Tool calls read from the text each family writes (``services/gateway/tool_parsers.py``), whole
and streamed through ``ToolCallReader``, and reasoning split from the answer
(``services/gateway/reasoning.py``, ``chat_output.py``). The recorded texts follow the formats
the families document."""

from __future__ import annotations

import json

import pytest

from folio.services.gateway.chat_output import OutputReader
from folio.services.gateway.reasoning import ReasoningSplitter, resolve_parser
from folio.services.gateway.structured import ToolCallReader
from folio.services.gateway.tool_parsers import parse_calls

NAMES = {"get_weather", "get_time"}
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
WEATHER = {"city": "Paris", "days": 3}

# (parser, recorded text, content before the calls)
RECORDED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me check."),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None),
    ("pythonic", '[get_weather(city="Paris", days=3)]', None),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', None),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', None),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', None),
    ("qwen3_coder", "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "I will look."),
]


@pytest.mark.parametrize("parser", ["own", "auto"])
@pytest.mark.parametrize("fmt,text,content", RECORDED, ids=[f"{r[0]}-{i}" for i, r in enumerate(RECORDED)])
def test_each_family_format_parses_whole_and_streamed(fmt, text, content, parser):
    chosen = fmt if parser == "own" else "auto"
    got_content, calls = parse_calls(text, NAMES, chosen, SCHEMAS)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", WEATHER)]
    reader = ToolCallReader(mode="auto", names=NAMES, parser=chosen, schemas=SCHEMAS)
    deltas = [d for i in range(0, len(text), 3) for d in reader.stream_delta(text[i:i + 3], False)]
    deltas += reader.stream_delta("", True)
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert streamed.strip() == (content or "")  # nothing of the call leaked out as content
    sent = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [json.loads(c["function"]["arguments"]) for c in sent] == [WEATHER]


def test_several_calls_and_text_that_only_looks_like_one():
    text = '[get_weather(city="Paris"), get_time(tz="UTC")]'
    assert [c["function"]["name"] for c in parse_calls(text, NAMES)[1]] == ["get_weather", "get_time"]
    for plain in ["[1, 2, 3]", "[os.system('x')]", "[get_weather(*a)]", "It is sunny.", '{"name": "nope"}',
                  "[TOOL_CALLS]get_weather[ARGS]{not json"]:
        assert parse_calls(plain, NAMES) == (plain, [])
    # a format other than the one chosen is content
    hermes = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert parse_calls(hermes, NAMES, "mistral") == (hermes, [])


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("qwen3", "<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n", "It is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),  # enable_thinking false: no block in the output
    ("qwen3", "<think>\ncut short by max_tokens", "\ncut short by max_tokens", None),
    ("deepseek_r1", "Two and two.</think>\n\nIt is 4.", "Two and two.", "It is 4."),
    ("deepseek_r1", "<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
])
def test_reasoning_splits_whole_and_streamed_alike(parser, text, reasoning, content):
    assert ReasoningSplitter(parser).split(text) == (reasoning, content)
    for step in (1, 2, 7):
        splitter, got_r, got_c = ReasoningSplitter(parser), "", ""
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            r, c = splitter.feed(piece, i == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r or None, got_c or None) == (reasoning, content), step


def test_tool_calls_are_read_from_the_answer_not_the_reasoning():
    thought = '<think>\nMaybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>? No, weather.\n</think>\n\n'
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    reader = OutputReader(ReasoningSplitter("qwen3"), ToolCallReader(mode="auto", names=NAMES))
    reasoning, content, calls = reader.message(thought + call)
    assert "Maybe" in reasoning and content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    reader = OutputReader(ReasoningSplitter("qwen3"), ToolCallReader(mode="auto", names=NAMES))
    text = thought + call
    deltas = [d for i in range(0, len(text), 4) for d in reader.stream_delta(text[i:i + 4], False)]
    deltas += reader.stream_delta("", True)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought[len("<think>"):thought.index("</think>")]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
    assert not any(d.get("content") for d in deltas)


def test_auto_reasoning_parser_follows_the_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert resolve_parser("auto", str(tmp_path)) == "qwen3"
    assert resolve_parser("auto", "DeepSeek-R1-Distill-Qwen-7B") == "deepseek_r1"
    assert resolve_parser("auto", "SmolLM2-135M-Instruct") is None
    assert resolve_parser("none", str(tmp_path)) is None and resolve_parser("deepseek_r1", "x") == "deepseek_r1"


def test_structured_output_constrains_the_answer_after_the_think_block():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from folio.core.structured.grammar import build_grammar
    from folio.services.gateway.convert import chat_generate_requests
    from folio.services.gateway.protocol import ChatCompletionRequest, parse

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    req = parse(json.dumps(body).encode(), ChatCompletionRequest)
    spec = chat_generate_requests(req, "r", reasoning=True)[0].guided
    assert chat_generate_requests(req, "r")[0].guided.kind == "json_schema"  # no reasoning: as before
    grammar = build_grammar(spec.kind, spec.spec)
    assert accepts(grammar, '<think>\nIs a < b? </b> no.\n</think>\n\n{"a": 1}')
    assert accepts(grammar, 'DeepSeek-R1 opens the block in the prompt</think>{"a": 1}')
    for bad in ['{"a": 1}', '<think>x</think>\n\nnot json', '<think>x</think>{"b": 1}']:
        assert not accepts(grammar, bad), bad
    # guided_regex, the low-level form, still constrains the whole output
    regex = parse(json.dumps({**body, "response_format": None, "guided_regex": "a+"}).encode(), ChatCompletionRequest)
    assert chat_generate_requests(regex, "r", reasoning=True)[0].guided.kind == "regex"

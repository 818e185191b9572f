"""The Responses and Messages APIs' bodies as chat requests (``responses_api.to_chat``,
``messages_api.to_chat``), their refusals, the response store's bounds, and Anthropic's error
shape: pure functions, no stack (the clients drive a real one in
``tests/e2e/test_responses_messages_api.py``)."""

from __future__ import annotations

import time

import msgspec
import pytest

from folio.services.gateway import messages_api, responses_api
from folio.services.gateway.protocol import ApiError


def responses_chat(body: dict, history: list[dict] | None = None) -> tuple[dict, list[dict]]:
    req = msgspec.convert(body, responses_api.ResponsesRequest)
    return responses_api.to_chat(req, body, history or [])


def test_responses_input_items_become_chat_messages():
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                    {"type": "input_text", "text": "Paris?"}]},
                      {"type": "reasoning", "summary": []},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                      {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
            "instructions": "Be brief.", "max_output_tokens": 7, "seed": 3,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}}
    chat, conversation = responses_chat(body, history=[{"role": "user", "content": "earlier"}])
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert conversation[0] == {"role": "user", "content": "earlier"} and "Be brief." not in str(conversation)
    assert chat["messages"][2] == {"role": "user", "content": "Weather in Paris?"}
    assert [c["id"] for c in chat["messages"][3]["tool_calls"]] == ["c1", "c2"]  # consecutive calls: one turn
    assert chat["messages"][4] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert chat["max_completion_tokens"] == 7 and chat["seed"] == 3
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


@pytest.mark.parametrize("body,param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
])
def test_responses_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as exc:
        responses_chat(body)
    assert exc.value.status == 400 and exc.value.param == param


def test_the_response_store_is_bounded_and_forgets_after_its_ttl(monkeypatch):
    store = responses_api.ResponseStore(max_size=2, ttl_s=10.0)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    now = time.monotonic()
    monkeypatch.setattr(responses_api.time, "monotonic", lambda: now + 11.0)
    assert store.get("r2") is None


def messages_chat(body: dict) -> dict:
    return messages_api.to_chat(msgspec.convert(body, messages_api.MessagesRequest), body)


def test_messages_blocks_become_chat_messages():
    body = {"max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["END"],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                                           {"type": "text", "text": "Checking."},
                                                           {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [{"type": "text", "text": "sunny"}]},
                                                      {"type": "text", "text": "And tomorrow?"}]}]}
    chat = messages_chat(body)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][2]["content"] == "Checking."
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert chat["messages"][4] == {"role": "user", "content": "And tomorrow?"}
    assert chat["max_completion_tokens"] == 9 and chat["stop"] == ["END"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("body", [
    {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305"}]},
])
def test_messages_refusals_in_anthropics_shape(body):
    with pytest.raises(ApiError) as exc:
        messages_chat(body)
    shaped = messages_api.error_body(exc.value)
    assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"
    assert messages_api.error_body(ApiError("gone", 404))["error"]["type"] == "not_found_error"
    assert messages_api.error_body(ApiError("boom", 500))["error"]["type"] == "api_error"


def test_stop_reasons():
    assert messages_api.stop_of("stop", None, called=True) == ("tool_use", None)
    assert messages_api.stop_of("length", None, called=False) == ("max_tokens", None)
    assert messages_api.stop_of("stop", "END", called=False) == ("stop_sequence", "END")
    assert messages_api.stop_of("stop", 2, called=False) == ("end_turn", None)  # an EOS token id


def test_chat_template_kwargs_reach_the_template(tmp_path, smollm_tokenizer_dir):
    from folio.core.tokenizer.text import TextTokenizer
    from folio.shared.messages import ChatMessage
    from folio.testing.models import write_qwen3_tokenizer

    write_qwen3_tokenizer(tmp_path, smollm_tokenizer_dir)
    tok = TextTokenizer(tmp_path)
    chat = [ChatMessage(role="user", content="hi")]
    assert "<think>" not in tok.render_chat(chat, None, True)
    off = tok.render_chat(chat, None, True, {"enable_thinking": False, "add_generation_prompt": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the variables set here stay

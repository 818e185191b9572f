"""Each family's own chat template, from its tokenizer config. ``folio serve`` (five processes, real
HTTP) runs a tiny chat model that carries Gemma 2's template: a system message, which the template
refuses, is a 400 whose OpenAI-style error object says why, streamed or not, and the server keeps
serving; the conversations it accepts render as transformers renders them. Qwen3's and Phi-3's
templates render through the tokenizer service's code as transformers' ``apply_chat_template``
renders them on the same tokenizer.

The templates are the families' published ones (Gemma 2 whole; Qwen3 and Phi-3 without their
tool-calling branches, which these conversations never reach)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from folio.shared.messages import ChatMessage, GenerateRequest
from folio.shared.sampling import SamplingParams
from folio.core.tokenizer.text import RequestError, TextTokenizer
from folio.testing.models import write_tiny_chat_model
from folio.testing.server import start_server, stop_server

GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
SYSTEM_AND_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
CONVERSATION = [{"role": "user", "content": "  Two plus two?  "}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\nFour."},
                {"role": "user", "content": "And three?"}]


def with_template(folder: Path, template: str) -> str:
    """The tiny chat model's tokenizer with ``template`` as its tokenizer_config's chat template."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # it would win over the config's
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return str(folder)


def reference_ids(model_dir: str, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def served_ids(model_dir: str, messages: list[dict]) -> list[int]:
    """The prompt the tokenizer service makes of a chat request."""
    req = GenerateRequest(req_id="c", messages=[ChatMessage(**m) for m in messages],
                          sampling=SamplingParams(max_tokens=4))
    return TextTokenizer(model_dir).prepare(req)[0]


@pytest.fixture(scope="module")
def gemma_chat_model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return with_template(Path(write_tiny_chat_model(tmp_path_factory.mktemp("gemma-chat"), smollm_tokenizer_dir)), GEMMA2)


@pytest.fixture(scope="module")
def gemma_server(gemma_chat_model):
    srv = start_server(gemma_chat_model, "--num-kv-blocks", "64", "--dtype", "float32", "--max-num-seqs", "4",
                       "--served-model-name", "m")
    yield srv
    stop_server(srv)


def post(server, path: str, body: dict) -> tuple[int, dict | str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.base_url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if not body.get("stream") else text
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


def test_a_system_message_gemma_refuses_is_a_400_that_says_why_and_the_server_goes_on(gemma_server,
                                                                                     gemma_chat_model):
    import openai

    from tests.services.openai_schema import validate

    for stream in (False, True):
        status, body = post(gemma_server, "/v1/chat/completions",
                            {"model": "m", "messages": SYSTEM_AND_USER, "max_tokens": 4, "stream": stream})
        assert status == 400, body
        validate(body, "ErrorResponse")
        assert "System role not supported" in body["error"]["message"]
        assert body["error"]["param"] == "messages" and body["error"]["type"] == "invalid_request_error"
    status, body = post(gemma_server, "/v1/chat/completions",
                        {"model": "m", "messages": CONVERSATION[:2] + CONVERSATION[1:], "max_tokens": 4})
    assert status == 400 and "Conversation roles must alternate" in body["error"]["message"]
    # the official client sees the same refusal, and the next conversation is served
    client = openai.OpenAI(base_url=gemma_server.base_url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        client.chat.completions.create(model="m", messages=SYSTEM_AND_USER, max_tokens=4)
    reply = client.chat.completions.create(model="m", messages=CONVERSATION, max_tokens=4, temperature=0.0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    assert reply.usage.prompt_tokens == len(reference_ids(gemma_chat_model, CONVERSATION))


def test_the_gateway_renders_what_gemma_accepts_as_transformers_does(gemma_server, gemma_chat_model):
    status, body = post(gemma_server, "/tokenize", {"model": "m", "messages": CONVERSATION})
    assert status == 200, body
    assert body["tokens"] == reference_ids(gemma_chat_model, CONVERSATION)


@pytest.mark.parametrize("template", [QWEN3, PHI3], ids=["qwen3", "phi3"])
def test_qwen3_and_phi3_templates_render_as_their_tokenizers_do(tmp_path, smollm_tokenizer_dir, template):
    folder = tmp_path / "chat"
    folder.mkdir()
    for f in Path(smollm_tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "config")):
            (folder / f.name).write_bytes(f.read_bytes())
    model_dir = with_template(folder, template)
    for messages in (SYSTEM_AND_USER, CONVERSATION, SYSTEM_AND_USER + CONVERSATION[1:]):
        ids = served_ids(model_dir, messages)
        assert ids == reference_ids(model_dir, messages)
    text = TextTokenizer(model_dir).hf.decode(served_ids(model_dir, CONVERSATION))
    assert ("<|im_start|>assistant\nFour.<|im_end|>" in text) if template is QWEN3 else ("<|assistant|>\n" in text)


def test_a_template_exception_is_a_request_error_in_the_tokenizer(tmp_path, smollm_tokenizer_dir):
    folder = tmp_path / "gemma"
    folder.mkdir()
    for f in Path(smollm_tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "config")):
            (folder / f.name).write_bytes(f.read_bytes())
    model_dir = with_template(folder, GEMMA2)
    with pytest.raises(RequestError, match="the chat template rejected the messages: System role not supported"):
        served_ids(model_dir, SYSTEM_AND_USER)
    assert served_ids(model_dir, SYSTEM_AND_USER[1:]) == reference_ids(model_dir, SYSTEM_AND_USER[1:])

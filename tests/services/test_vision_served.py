"""Images in through the real stack (``folio serve``: five processes, ipc:// sockets, HTTP) on a
tiny random LLaVA with its own processor, against transformers' ``generate`` on the same weights
in fp32: the official ``openai`` client's ``chat.completions.create`` with an ``image_url``
data-URL part, and an http URL fetched from a host ``--allowed-media-domains`` names; then the bad
inputs (broken base64, not an image, too large, too many images, a disallowed host, an image to a
text-only model), each a 400 with an OpenAI error object, and the server answering after them."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import openai
import pytest

from folio.testing.models import write_tiny_chat_model, write_tiny_llava_model
from folio.testing.server import folio_metrics, post_json, served, start_server, stop_server
from tests.folio.test_vision import IMAGES, QUESTIONS, data_url, reference_tokens

pytestmark = pytest.mark.slow

FLAGS = ["--dtype", "float32", "--quantization", "none", "--num-kv-blocks", "64", "--max-num-batched-tokens", "16",
         "--served-model-name", "tiny", "--allowed-media-domains", "127.0.0.1", "--max-image-bytes", "4000",
         "--limit-images-per-prompt", "2"]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_llava_model(tmp_path_factory.mktemp("tiny-llava-served"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def reference(llava_dir):
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return (LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(llava_dir))


@pytest.fixture(scope="module")
def server(llava_dir):
    with served(llava_dir, *FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def image_host():
    """A local http server with the second picture at /pic.png."""
    buf = io.BytesIO()
    IMAGES[1].save(buf, format="PNG")
    png = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/pic.png" else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png if self.path == "/pic.png" else b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def image_message(url: str, question: str = QUESTIONS[0]) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def post_chat(base_url: str, messages: list[dict]) -> tuple[int, dict]:
    return post_json(base_url + "/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 8,
                                                      "temperature": 0})


def test_openai_client_chat_with_images_equals_transformers(server, reference, image_host):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    processor = reference[1]
    for question, image, url in [(QUESTIONS[0], IMAGES[0], data_url(IMAGES[0])),
                                 (QUESTIONS[2], IMAGES[1], data_url(IMAGES[1])),
                                 (QUESTIONS[1], IMAGES[1], f"http://127.0.0.1:{image_host}/pic.png")]:
        want, prompt = reference_tokens(reference, question, image, max_new_tokens=8)
        out = client.chat.completions.create(model="tiny", messages=image_message(url, question), max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == processor.tokenizer.decode(want, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(prompt)
    # /tokenize counts what the chat would: the processor's ids, placeholders included
    status, body = post_json(server.base_url.removesuffix("/v1") + "/tokenize",
                             {"model": "tiny", "messages": image_message(data_url(IMAGES[0]), QUESTIONS[0])})
    assert status == 200, body
    assert body["tokens"] == reference_tokens(reference, QUESTIONS[0], IMAGES[0], max_new_tokens=1)[1]
    status, body = post_json(server.base_url.removesuffix("/v1") + "/tokenize",
                             {"model": "tiny", "messages": image_message("data:image/png;base64,AAAA")})
    assert status == 400 and "image" in body["error"]["message"], body
    # /metrics: the tower's images, their placeholder tokens (25 each here) and its time
    metrics = folio_metrics(server)
    assert metrics["folio:images_encoded_total"] >= 3
    assert metrics["folio:image_tokens_total"] == 25 * metrics["folio:images_encoded_total"]
    assert metrics["folio:encoder_seconds_total"] > 0


def test_bad_images_get_400_and_the_server_keeps_serving(server, image_host, tmp_path, smollm_tokenizer_dir):
    big = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + bytes(5000)).decode()
    text = "data:image/png;base64," + base64.b64encode(b"just some text").decode()
    cases = {
        "base64 is broken": image_message("data:image/png;base64,@@not base64@@"),
        "is not an image": image_message(text),
        "larger than the 4000 bytes": image_message(big),
        "at most 2 (--limit-images-per-prompt)": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}} for _ in range(3)]}],
        "not allowed": image_message(f"http://localhost:{image_host}/pic.png"),
        "expected a data URL": image_message("ftp://127.0.0.1/pic.png"),
        "3 <image> tokens and 2 images": [{"role": "user", "content": "USER: <image> hi"}, {
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}] * 2}],
    }
    for message, messages in cases.items():
        status, body = post_chat(server.base_url, messages)
        assert status == 400, (message, body)
        assert message in body["error"]["message"] and body["error"]["type"] == "invalid_request_error", body
    status, body = post_chat(server.base_url, image_message(data_url(IMAGES[0])))
    assert status == 200 and body["choices"][0]["message"]["content"]
    # an image to a text-only model
    text_only = start_server(write_tiny_chat_model(tmp_path / "text", smollm_tokenizer_dir), "--dtype", "float32",
                             "--num-kv-blocks", "32", "--served-model-name", "tiny")
    try:
        status, body = post_chat(text_only.base_url, image_message(data_url(IMAGES[0])))
        assert status == 400 and "text-only model" in body["error"]["message"], body
        status, body = post_chat(text_only.base_url, [{"role": "user", "content": "hi"}])
        assert status == 200
    finally:
        stop_server(text_only)




def test_the_responses_and_messages_apis_take_images_as_chat_does(server, reference):
    """The Responses API's ``input_image`` (the official client's ``responses.create``) and the
    Messages API's base64 ``image`` block give chat's text for the same image and question; a
    bad image there is a 400 in the API's own error shape, and the server answers after it."""
    processor = reference[1]
    want, _ = reference_tokens(reference, QUESTIONS[0], IMAGES[0], max_new_tokens=8)
    text = processor.tokenizer.decode(want, skip_special_tokens=True)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = client.responses.create(model="tiny", max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                                  input=[{"role": "user", "content": [
                                      {"type": "input_image", "image_url": data_url(IMAGES[0])},
                                      {"type": "input_text", "text": QUESTIONS[0]}]}])
    assert out.output_text == text
    png = data_url(IMAGES[0]).split(",", 1)[1]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    status, body = post_json(server.base_url + "/messages", {
        "model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": QUESTIONS[0]}]}]})
    assert status == 200 and body["content"][0]["text"] == text, body
    bad = {**block, "source": {**block["source"], "media_type": "text/plain"}}
    status, body = post_json(server.base_url + "/messages", {
        "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [bad, {"type": "text", "text": "x"}]}]})
    assert status == 400 and body["type"] == "error" and "media_type" in body["error"]["message"], body
    status, body = post_json(server.base_url + "/responses", {
        "model": "tiny", "max_output_tokens": 8,
        "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})
    assert status == 400 and "file_id is not supported" in body["error"]["message"], body
    status, body = post_json(server.base_url + "/responses", {
        "model": "tiny", "max_output_tokens": 8, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,@@"}, {"type": "input_text", "text": "x"}]}]})
    assert status == 400 and "base64 is broken" in body["error"]["message"], body
    status, body = post_json(server.base_url + "/messages", {
        "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200

"""Images in through the real stack (``folio serve``: five processes, ipc:// sockets, HTTP) on a
tiny random Gemma 3 vision-language model with its own ``Gemma3Processor``, against transformers'
``generate`` on the same weights in fp32, in the default mode and batch-invariant: the official
``openai`` client's ``chat.completions.create`` with one and with two data-URL ``image_url``
parts, 16 tokens a step (one image's placeholders, which a step holds whole)."""

from __future__ import annotations

import openai
import pytest
import torch

from folio.testing.models import write_tiny_gemma3_vlm_model
from folio.testing.server import served
from tests.folio.test_vision import IMAGES, QUESTIONS, data_url, greedy_reference

pytestmark = pytest.mark.slow

FLAGS = ["--dtype", "float32", "--quantization", "none", "--num-kv-blocks", "64", "--max-num-batched-tokens", "16",
         "--served-model-name", "tiny", "--limit-images-per-prompt", "2"]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_gemma3_vlm_model(tmp_path_factory.mktemp("tiny-gemma3-served"), smollm_tokenizer_dir)


@pytest.fixture(scope="module", params=["default", "batch-invariant"])
def server(request, gemma3_dir):
    with served(gemma3_dir, *FLAGS, *(["--batch-invariant"] if request.param == "batch-invariant" else [])) as srv:
        yield srv


def reference_tokens(folder: str, question: str, images: list, max_new_tokens: int):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    msgs = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = processor(images=images, text=text, return_tensors="pt", add_special_tokens=False)
    tokens, prompt = greedy_reference(model, inputs, max_new_tokens)
    return processor.tokenizer.decode(tokens, skip_special_tokens=True), len(prompt)


def test_openai_client_chat_with_images_equals_transformers(server, gemma3_dir):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    texts = []
    for question, images in [(QUESTIONS[0], [IMAGES[0]]), (QUESTIONS[0], [IMAGES[1]]), (QUESTIONS[1], IMAGES[::-1])]:
        want, prompt_len = reference_tokens(gemma3_dir, question, images, max_new_tokens=8)
        parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts + [{"type": "text", "text": question}]}],
            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == want
        assert out.usage.prompt_tokens == prompt_len
        texts.append(want)
    assert texts[0] != texts[1]  # the same text, another image

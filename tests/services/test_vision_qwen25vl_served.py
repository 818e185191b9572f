"""Images in through the real stack (``folio serve``: five processes, ipc:// sockets, HTTP) on a
tiny random Qwen2.5-VL with its own processor, against transformers' ``generate`` on the same
weights in fp32: the official ``openai`` client's ``chat.completions.create`` with data-URL
``image_url`` parts, images of two sizes (different placeholder counts, M-RoPE positions) and two
in one message, 8 tokens a step; ``/metrics`` counting the tower's images and their placeholders."""

from __future__ import annotations


import openai
import pytest

from folio.testing.models import write_tiny_qwen25_vl_model
from folio.testing.server import folio_metrics, served
from tests.folio.test_vision import QUESTIONS, data_url
from tests.folio.test_vision_qwen25vl import PICTURES, PLACEHOLDERS, reference_tokens

pytestmark = pytest.mark.slow

FLAGS = ["--dtype", "float32", "--quantization", "none", "--num-kv-blocks", "64", "--max-num-batched-tokens", "8",
         "--served-model-name", "tiny", "--limit-images-per-prompt", "2"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_qwen25_vl_model(tmp_path_factory.mktemp("tiny-qwen25vl-served"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def server(qwen_dir):
    with served(qwen_dir, *FLAGS) as srv:
        yield srv


def test_openai_client_chat_with_images_equals_transformers(server, qwen_dir):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from folio.core.tokenizer.vision_inputs import load_processor

    reference = (Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval(),
                 load_processor(qwen_dir))
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    cases = [(QUESTIONS[0], [PICTURES[0]]), (QUESTIONS[2], [PICTURES[1]]), (QUESTIONS[1], PICTURES[1::-1])]
    for question, images in cases:
        want, prompt = reference_tokens(reference, question, images, max_new_tokens=8)
        parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts + [{"type": "text", "text": question}]}],
            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == reference[1].tokenizer.decode(want, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(prompt)
    metrics = folio_metrics(server)
    assert metrics["folio:images_encoded_total"] == 4
    assert metrics["folio:image_tokens_total"] == PLACEHOLDERS[0] * 2 + PLACEHOLDERS[1] * 2
    assert metrics["folio:encoder_seconds_total"] > 0

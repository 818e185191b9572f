"""Images in through the real stack (``folio serve``: five processes, ipc:// sockets, HTTP) on a
tiny random Idefics3 (SmolVLM's architecture) with its own ``Idefics3Processor``, against
transformers' ``generate`` on the same weights in fp32: the official ``openai`` client's
``chat.completions.create`` with one and with two data-URL ``image_url`` parts, and ``/metrics``
counting the tower's images and their placeholder tokens."""

from __future__ import annotations


import openai
import pytest

from folio.testing.models import write_tiny_idefics3_model
from folio.testing.server import folio_metrics, served
from tests.folio.test_vision import IMAGES, QUESTIONS, data_url
from tests.folio.test_vision_idefics3 import TOKENS_PER_TILE, load_reference, reference_tokens

pytestmark = pytest.mark.slow

FLAGS = ["--dtype", "float32", "--quantization", "none", "--num-kv-blocks", "64", "--max-num-batched-tokens", "8",
         "--served-model-name", "tiny", "--limit-images-per-prompt", "2"]


@pytest.fixture(scope="module")
def idefics_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_idefics3_model(tmp_path_factory.mktemp("tiny-idefics3-served"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def server(idefics_dir):
    with served(idefics_dir, *FLAGS) as srv:
        yield srv


def test_openai_client_chat_with_images_equals_transformers(server, idefics_dir):
    reference = load_reference(idefics_dir)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    for question, images in [(QUESTIONS[0], [IMAGES[0]]), (QUESTIONS[2], [IMAGES[1]]), (QUESTIONS[1], IMAGES[::-1])]:
        want, prompt = reference_tokens(reference, question, images, max_new_tokens=8)
        parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": parts + [{"type": "text", "text": question}]}],
            max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == reference[1].tokenizer.decode(want, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(prompt)
    metrics = folio_metrics(server)
    assert metrics["folio:images_encoded_total"] == 4
    assert metrics["folio:image_tokens_total"] == TOKENS_PER_TILE * 4
    assert metrics["folio:encoder_seconds_total"] > 0

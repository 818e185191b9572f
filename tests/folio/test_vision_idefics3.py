"""Images in, offline (``folio.LLM``), for a second family: a random-weight Idefics3
(``Idefics3ForConditionalGeneration``, SmolVLM's architecture: a SigLIP-style tower and the
pixel-shuffle connector over a Llama) with its own ``Idefics3Processor``, against transformers'
``generate``, fp32: greedy text equal token for token for several prompts and two images, in one
batch and with a chunked prefill that splits an image's placeholders over steps (the tower run
once per image), and in batch-invariant mode through preemptions and recomputes; with the processor's image splitting on, an image as five tiles (four crops and
the whole), each its own run of placeholders; the prefix cache keyed by image content."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.testing.models import write_tiny_idefics3_model
from tests.folio.test_vision import (IMAGES, QUESTIONS, SYSTEM, conversation, data_url, greedy_reference,
                                     image_runs)

ENGINE = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 96, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TOKENS_PER_TILE = 16  # a 32-pixel tile, 4-pixel patches: 8 x 8 patches, shuffled by 2: 4 x 4 rows


@pytest.fixture(scope="module")
def idefics_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_idefics3_model(tmp_path_factory.mktemp("tiny-idefics3"), smollm_tokenizer_dir)


def load_reference(folder: str):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    return (Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(folder))


@pytest.fixture(scope="module")
def reference(idefics_dir):
    return load_reference(idefics_dir)


def reference_tokens(reference, question: str, image, system: bool = False, max_new_tokens: int = 10):
    """transformers' greedy tokens and prompt ids, the processor's own chat template and inputs
    (``image``: one picture or a list of them, all before the question)."""
    model, processor = reference
    images = image if isinstance(image, list) else [image]
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    msgs.append({"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]})
    text = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = processor(images=images, text=text, return_tensors="pt", add_special_tokens=False)
    return greedy_reference(model, inputs, max_new_tokens)


def test_greedy_text_equals_transformers_batched_and_chunked(idefics_dir, reference):
    # 8 tokens a step: an image's 16 placeholders span two or three steps
    llm = LLM(idefics_dir, max_num_batched_tokens=8, **ENGINE)
    cases = [(q, im) for q in QUESTIONS for im in IMAGES]
    outs = llm.chat([conversation(q, im) for q, im in cases], GREEDY, use_tqdm=False)
    image_token = llm.engine.tokenizer.images.image_token_id
    for out, (q, im) in zip(outs, cases):
        want, prompt = reference_tokens(reference, q, im)
        assert out.prompt_token_ids == prompt  # the processor's expansion of <image>
        assert image_runs(prompt, image_token) == [TOKENS_PER_TILE]
        assert list(out.outputs[0].token_ids) == want, (q, IMAGES.index(im))
    # the tower ran once per image of each request, not once per chunk
    assert llm.engine.core.runner.image_inputs.num_encoded == len(cases)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the image matters
    # a prompt with the image token written in it, the processor's own expansion
    want, prompt = reference_tokens(reference, QUESTIONS[0], IMAGES[1])
    text = "<|im_start|>User:<image>" + QUESTIONS[0] + "<end_of_utterance>\nAssistant:"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[1]}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt and list(out.outputs[0].token_ids) == want
    # two images in one message, in their order
    want, prompt = reference_tokens(reference, QUESTIONS[1], IMAGES[::-1])
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in IMAGES[::-1]]
            + [{"type": "text", "text": QUESTIONS[1]}]}]
    out = llm.chat(two, GREEDY, use_tqdm=False)[0]
    assert image_runs(out.prompt_token_ids, image_token) == [TOKENS_PER_TILE] * 2
    assert out.prompt_token_ids == prompt and list(out.outputs[0].token_ids) == want


def test_batch_invariant_mode_with_preemption_keeps_the_text(idefics_dir, reference):
    # 8 blocks of 16 for four requests of ~45 prompt + 24 output tokens: some are preempted and recomputed
    tight = LLM(idefics_dir, **{**ENGINE, "num_kv_blocks": 8, "max_num_batched_tokens": 16, "batch_invariant": True})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cases = [(QUESTIONS[i % 3], IMAGES[i % 2]) for i in range(4)]
    outs = tight.chat([conversation(q, im) for q, im in cases], params, use_tqdm=False)
    assert tight.engine.core.scheduler.counters["num_preemptions"] > 0
    for out, (q, im) in zip(outs, cases):
        assert list(out.outputs[0].token_ids) == reference_tokens(reference, q, im, max_new_tokens=24)[0]


def test_prefix_cache_tells_images_apart(idefics_dir):
    cached = LLM(idefics_dir, max_num_batched_tokens=256, **ENGINE)
    block, question = 16, QUESTIONS[2] + " Answer in a few words."  # a text after the image longer than a block

    def chat(image):
        return cached.chat(conversation(question, image, system=True), GREEDY, use_tqdm=False)[0]

    first = chat(IMAGES[0])
    offset = first.prompt_token_ids.index(cached.engine.tokenizer.images.image_token_id)
    assert offset > block  # the system turn fills a whole block before the image
    other = chat(IMAGES[1])
    assert other.prompt_token_ids == first.prompt_token_ids  # the same tokens: only the pixels differ
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    # the blocks before the image are shared, none from the one holding its first placeholder on
    assert other.num_cached_tokens == offset // block * block
    again = chat(IMAGES[0])
    # the same image: every full block is a hit (the last prompt token is always computed), past the image
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // block * block >= offset + TOKENS_PER_TILE
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_split_images_are_tiles_of_their_own(tmp_path, smollm_tokenizer_dir):
    # a 50 x 40 picture, resized to 64 x 64 (two tiles a side): four crops and the whole image
    folder = write_tiny_idefics3_model(tmp_path / "split", smollm_tokenizer_dir, do_image_splitting=True)
    reference = load_reference(folder)
    llm = LLM(folder, max_num_batched_tokens=24, **ENGINE)
    cases = [(QUESTIONS[0], IMAGES[0]), (QUESTIONS[1], IMAGES[1])]
    outs = llm.chat([conversation(q, im) for q, im in cases], GREEDY, use_tqdm=False)
    image_token = llm.engine.tokenizer.images.image_token_id
    for out, (q, im) in zip(outs, cases):
        want, prompt = reference_tokens(reference, q, im)
        assert out.prompt_token_ids == prompt
        assert image_runs(prompt, image_token) == [TOKENS_PER_TILE] * 5  # split by row/col and global tokens
        assert list(out.outputs[0].token_ids) == want
    assert llm.engine.core.runner.image_inputs.num_encoded == 5 * len(cases)

"""Images in, offline (``folio.LLM``), against transformers on the same random-weight LLaVA
(``LlavaForConditionalGeneration``: a CLIP tower and projector over a Llama) with its own
``LlavaProcessor``, fp32: greedy text equal token for token for several prompts and two images,
in one batch and with a chunked prefill that splits an image's placeholders over several steps,
the tower run once per image however many chunks cover it, and again after a preemption by
recompute; the prefix cache keyed by image content (different images share no block past the
first image, the same image twice is a hit); and the refusals."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from folio import LLM, SamplingParams
from folio.testing.models import write_tiny_llava_model

ENGINE = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 96, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = ("You look at pictures closely and say what you see in them, in a few plain words, "
          "without guessing at what is not there.")
QUESTIONS = ["What is this?", "Describe the picture.", "Which colour is it, and what shape?"]


def picture(seed: int):
    """A small RGB picture of random blocks (PIL)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    cells = torch.randint(0, 256, (5, 4, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(cells.repeat_interleave(10, 0).repeat_interleave(10, 1).numpy())  # 50 x 40


IMAGES = [picture(1), picture(2)]


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def greedy_reference(model, inputs, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(transformers' greedy tokens, the prompt ids) of one processed prompt, ``max_new_tokens`` exactly."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    prompt = inputs["input_ids"][0].tolist()
    return out[0, len(prompt):].tolist(), prompt


def image_runs(ids: list[int], image_token_id: int) -> list[int]:
    """The lengths of the prompt's runs of placeholder tokens."""
    runs, n = [], 0
    for t in ids + [None]:
        if t == image_token_id:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    return runs


def conversation(question: str, image, system: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    return msgs + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_llava_model(tmp_path_factory.mktemp("tiny-llava"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def reference(llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return (LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(llava_dir))


def reference_tokens(reference, question: str, image, system: bool = False, max_new_tokens: int = 10):
    """transformers' greedy tokens and prompt ids, the processor's own chat template and inputs."""
    model, processor = reference
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    msgs.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    text = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = processor(images=[image], text=text, return_tensors="pt", add_special_tokens=False)
    return greedy_reference(model, inputs, max_new_tokens)


@pytest.fixture(scope="module")
def llm(llava_dir) -> LLM:
    return LLM(llava_dir, max_num_batched_tokens=16, **ENGINE)  # 16 tokens a step: an image's 25 span 2-3 steps


def test_greedy_text_equals_transformers_batched_and_chunked(llm, reference):
    cases = [(q, im) for q in QUESTIONS for im in IMAGES]
    encoded_before = llm.engine.core.runner.image_inputs.num_encoded
    outs = llm.chat([conversation(q, im) for q, im in cases], GREEDY, use_tqdm=False)
    placeholders = 0
    for out, (q, im) in zip(outs, cases):
        want, prompt = reference_tokens(reference, q, im)
        assert out.prompt_token_ids == prompt  # the processor's expansion of <image>
        assert list(out.outputs[0].token_ids) == want, (q, IMAGES.index(im))
        placeholders = prompt.count(llm.engine.tokenizer.images.image_token_id)
    assert placeholders == 25 > 16  # each image's placeholders ran over more than one chunk
    # the tower ran once per image of each request, not once per chunk
    assert llm.engine.core.runner.image_inputs.num_encoded - encoded_before == len(cases)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the image matters


def test_batch_invariant_mode_gives_transformers_text_too(llava_dir, reference):
    """``batch_invariant``: every token attended as a decode, prefill included, image rows too."""
    invariant = LLM(llava_dir, max_num_batched_tokens=16, batch_invariant=True, **ENGINE)
    cases = [(QUESTIONS[0], IMAGES[0]), (QUESTIONS[1], IMAGES[1])]
    outs = invariant.chat([conversation(q, im) for q, im in cases], GREEDY, use_tqdm=False)
    for out, (q, im) in zip(outs, cases):
        assert list(out.outputs[0].token_ids) == reference_tokens(reference, q, im)[0]


def test_generate_with_an_image_in_the_prompt(llm, reference):
    want, prompt = reference_tokens(reference, QUESTIONS[0], IMAGES[1])
    text = "USER: <image>\n" + QUESTIONS[0] + "\nASSISTANT:"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[1]}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt and list(out.outputs[0].token_ids) == want


def test_preempted_and_recomputed_requests_keep_their_text(llava_dir, reference):
    # 10 blocks of 16 for four requests of ~40 prompt + 24 output tokens: some are preempted; one
    # image's tower a step (an encoder budget of 1 token) holds the other prompts back at their image
    tight = LLM(llava_dir, **{**ENGINE, "num_kv_blocks": 10, "max_num_batched_tokens": 16,
                              "max_num_encoder_input_tokens": 1})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cases = [(QUESTIONS[i % 3], IMAGES[i % 2]) for i in range(4)]
    outs = tight.chat([conversation(q, im) for q, im in cases], params, use_tqdm=False)
    assert tight.engine.core.scheduler.counters["num_preemptions"] > 0
    for out, (q, im) in zip(outs, cases):
        assert list(out.outputs[0].token_ids) == reference_tokens(reference, q, im, max_new_tokens=24)[0]


def test_prefix_cache_tells_images_apart(llava_dir):
    cached = LLM(llava_dir, max_num_batched_tokens=256, **ENGINE)
    block = 16
    first = cached.chat(conversation(QUESTIONS[0], IMAGES[0], system=True), GREEDY, use_tqdm=False)[0]
    image_token = cached.engine.tokenizer.images.image_token_id
    offset = first.prompt_token_ids.index(image_token)
    assert offset > block  # the system turn fills a whole block before the image
    other = cached.chat(conversation(QUESTIONS[0], IMAGES[1], system=True), GREEDY, use_tqdm=False)[0]
    assert other.prompt_token_ids == first.prompt_token_ids  # the same tokens: only the pixels differ
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    # the blocks before the image are shared, none from the one holding its first placeholder on
    assert other.num_cached_tokens == offset // block * block
    again = cached.chat(conversation(QUESTIONS[0], IMAGES[0], system=True), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= offset + 25  # past the image: a prefix hit
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_images_are_refused(llm, tmp_path, smollm_tokenizer_dir):
    def chat_with(url: str):
        return llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "hi"}]}], GREEDY, use_tqdm=False)

    with pytest.raises(ValueError, match="base64 is broken"):
        chat_with("data:image/png;base64,%%%not-base64")
    with pytest.raises(ValueError, match="is not an image"):
        chat_with("data:image/png;base64," + base64.b64encode(b"plain text, no pixels").decode())
    with pytest.raises(ValueError, match="PIL images or data URLs"):
        chat_with("http://example.com/cat.png")
    with pytest.raises(ValueError, match="1 <image> tokens and 2 images"):
        llm.generate({"prompt": "USER: <image>\nhi\nASSISTANT:", "multi_modal_data": {"image": IMAGES}},
                     GREEDY, use_tqdm=False)
    # a text-only model
    from folio.testing.models import write_tiny_chat_model

    text_only = LLM(write_tiny_chat_model(tmp_path / "text", smollm_tokenizer_dir), dtype="float32",
                    num_kv_blocks=16)
    with pytest.raises(ValueError, match="text-only model"):
        text_only.chat(conversation("hi", IMAGES[0]), GREEDY, use_tqdm=False)
    assert llm.chat(conversation(QUESTIONS[0], IMAGES[0]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids

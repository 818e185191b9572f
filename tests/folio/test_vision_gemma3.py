"""Images in, offline (``folio.LLM``), for Gemma 3: a random-weight ``Gemma3ForConditionalGeneration``
(a SigLIP tower and Gemma 3's projector over a Gemma 3 text model of a sliding-window layer and a
global one) with its own ``Gemma3Processor``, against transformers' ``generate``, fp32: greedy
text equal token for token for several prompts and two images, in one batch, with a chunked
prefill whose chunks end before an image rather than inside it (its placeholders attend each
other both ways; the window, 8, is shorter than an image's 16 placeholders), and in
batch-invariant mode through preemptions and recomputes; the prefix cache keyed by image content,
a hit that ends inside an image included; and the refusals."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.testing.models import write_tiny_gemma3_vlm_model
from tests.folio.test_vision import IMAGES, QUESTIONS, SYSTEM, conversation, greedy_reference

ENGINE = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 96, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
IMAGE_TOKENS = 16  # mm_tokens_per_image
WINDOW = 8  # the sliding-window layer's, shorter than an image


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_gemma3_vlm_model(tmp_path_factory.mktemp("tiny-gemma3-vlm"), smollm_tokenizer_dir,
                                       mm_tokens_per_image=IMAGE_TOKENS, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(gemma3_dir):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    return (Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(gemma3_dir))


def reference_tokens(reference, question: str, image, system: bool = False, max_new_tokens: int = 10):
    """transformers' greedy tokens and prompt ids, the processor's own chat template and inputs
    (its ``token_type_ids`` included: the mask that lets an image's placeholders see each other)."""
    model, processor = reference
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    msgs.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    text = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = processor(images=[image], text=text, return_tensors="pt", add_special_tokens=False)
    assert "token_type_ids" in inputs
    return greedy_reference(model, inputs, max_new_tokens)


def image_start(llm: LLM, prompt: list[int]) -> int:
    return prompt.index(llm.engine.tokenizer.images.image_token_id)


def test_greedy_text_equals_transformers_batched_and_chunked(gemma3_dir, reference):
    # 16 tokens a step, one image's placeholders: a chunk that would end inside an image ends before it
    llm = LLM(gemma3_dir, max_num_batched_tokens=IMAGE_TOKENS, **ENGINE)
    cases = [(q, im) for q in QUESTIONS for im in IMAGES]
    outs = llm.chat([conversation(q, im) for q, im in cases], GREEDY, use_tqdm=False)
    tokenizer = llm.engine.tokenizer.images.processor.tokenizer
    for out, (q, im) in zip(outs, cases):
        want, prompt = reference_tokens(reference, q, im)
        assert out.prompt_token_ids == prompt  # <start_of_image>, 16 placeholders, <end_of_image>
        start = image_start(llm, prompt)
        assert prompt[start - 1] == tokenizer.boi_token_id and prompt[start + IMAGE_TOKENS] == tokenizer.eoi_token_id
        assert start % IMAGE_TOKENS  # the budget's first chunk would have ended inside the image
        assert list(out.outputs[0].token_ids) == want, (q, IMAGES.index(im))
    assert llm.engine.core.runner.image_inputs.num_encoded == len(cases)  # the tower once per image
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the image matters


def test_generate_with_an_image_in_the_prompt_and_the_default_budget(gemma3_dir, reference):
    llm = LLM(gemma3_dir, **ENGINE)
    want, prompt = reference_tokens(reference, QUESTIONS[2], IMAGES[1])
    text = "<start_of_turn>user\n<start_of_image>" + QUESTIONS[2] + "<end_of_turn>\n<start_of_turn>model\n"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[1]}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt and list(out.outputs[0].token_ids) == want


def test_batch_invariant_mode_through_preemption_gives_transformers_text(gemma3_dir, reference):
    """``batch_invariant``: every token attended as a C decode row, an image's rows seeing its
    later placeholders; 8 blocks of 16 for four requests of ~32-37 prompt + 24 output tokens:
    some are preempted and recomputed, their images' towers run again."""
    tight = LLM(gemma3_dir, batch_invariant=True, **{**ENGINE, "num_kv_blocks": 8, "max_num_batched_tokens": 24})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cases = [(QUESTIONS[i % 3], IMAGES[i % 2]) for i in range(4)]
    outs = tight.chat([conversation(q, im) for q, im in cases], params, use_tqdm=False)
    assert tight.engine.core.scheduler.counters["num_preemptions"] > 0
    for out, (q, im) in zip(outs, cases):
        assert list(out.outputs[0].token_ids) == reference_tokens(reference, q, im, max_new_tokens=24)[0]


def test_prefix_cache_tells_images_apart_and_a_hit_may_end_inside_an_image(gemma3_dir, reference):
    cached = LLM(gemma3_dir, max_num_batched_tokens=256, **ENGINE)
    block = 16
    first = cached.chat(conversation(QUESTIONS[0], IMAGES[0], system=True), GREEDY, use_tqdm=False)[0]
    offset = image_start(cached, first.prompt_token_ids)
    assert offset > block  # the system turn fills a whole block before the image
    other = cached.chat(conversation(QUESTIONS[0], IMAGES[1], system=True), GREEDY, use_tqdm=False)[0]
    assert other.prompt_token_ids == first.prompt_token_ids  # the same tokens: only the pixels differ
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    # the blocks before the image are shared, none from the one holding its first placeholder on
    assert other.num_cached_tokens == offset // block * block
    for question in (QUESTIONS[0], QUESTIONS[2]):  # the same image again: a hit into the image
        again = cached.chat(conversation(question, IMAGES[0], system=True), GREEDY, use_tqdm=False)[0]
        # the hit ends inside the image: the step after it computes the image's last placeholders,
        # which see its first ones in the pool
        assert offset < again.num_cached_tokens < offset + IMAGE_TOKENS
        assert list(again.outputs[0].token_ids) == reference_tokens(reference, question, IMAGES[0], system=True)[0]


def test_a_token_budget_below_one_image_is_refused_at_start(gemma3_dir):
    with pytest.raises(ValueError, match="max-num-batched-tokens 8 is below one image's 16 placeholders"):
        LLM(gemma3_dir, max_num_batched_tokens=8, **ENGINE)


def test_the_executor_refuses_a_plan_whose_gemma3_image_is_not_marked_both_ways(gemma3_dir):
    """The scheduler keeps an image whole only when it is marked (``ImageInput.both_ways``, the
    tokenizer's mark for Gemma 3): a plan with an unmarked one is refused before anything runs."""
    import msgspec

    from folio.core.executor.runtime.plan_check import InvalidPlan
    from folio.shared.messages import ImageInput, NewRequestData, StepPlan
    from folio.shared.sampling import SamplingParams as WireSampling

    runner = LLM(gemma3_dir, **ENGINE).engine.core.runner
    pixels = torch.zeros(3, 32, 32).numpy()
    image = ImageInput(offset=2, length=IMAGE_TOKENS, hash="0" * 64, dtype="float32", shape=[3, 32, 32],
                       data=pixels.tobytes(), both_ways=True)
    new = NewRequestData(req_id="x", token_ids=[5] * 24, num_prompt_tokens=24, block_ids=[0, 1],
                         sampling=WireSampling(temperature=0.0, max_tokens=1), images=[image])
    unmarked = msgspec.structs.replace(new, images=[msgspec.structs.replace(image, both_ways=False)])
    with pytest.raises(InvalidPlan, match="image 0 is marked both_ways=False"):
        runner.execute(StepPlan(step_id=0, new_reqs=[unmarked], num_scheduled_tokens={"x": 24}))
    assert runner.image_inputs.num_encoded == 0
    # (a refused plan's requests stay out of later plans: the marked one comes under another id)
    marked = msgspec.structs.replace(new, req_id="y")
    result = runner.execute(StepPlan(step_id=1, new_reqs=[marked], num_scheduled_tokens={"y": 24}))
    assert result.req_ids == ["y"] and runner.image_inputs.num_encoded == 1  # the marked image runs


def test_an_untied_head_loads_from_its_own_weights(tmp_path, smollm_tokenizer_dir):
    """``tie_word_embeddings=False``: the checkpoint's ``language_model.lm_head.weight`` is the head."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    folder = write_tiny_gemma3_vlm_model(tmp_path / "untied", smollm_tokenizer_dir, tie_word_embeddings=False)
    reference = (Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval(),
                 AutoProcessor.from_pretrained(folder))
    llm = LLM(folder, **ENGINE)
    assert not llm.engine.core.runner.model.spec.tie_word_embeddings
    out = llm.chat(conversation(QUESTIONS[1], IMAGES[0]), GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == reference_tokens(reference, QUESTIONS[1], IMAGES[0])[0]

"""Images in, offline (``folio.LLM``), for Qwen2.5-VL: a random-weight
``Qwen2_5_VLForConditionalGeneration`` (a windowed ViT over each image's own patch grid, the patch
merger, a Qwen2 text model rotated by M-RoPE) with its own processor, against transformers'
``generate``, fp32: greedy text equal token for token for several prompts, images of two sizes
(different placeholder counts) and a two-image prompt, in one batch, with a chunked prefill that
splits an image's placeholders over steps; in batch-invariant mode through preemptions and
recomputes; the M-RoPE positions against transformers' ``get_rope_index``; the prefix cache
keyed by image content; speculative decoding refused at start."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from folio import LLM, SamplingParams
from folio.core.executor.runtime.mrope import ImageLayout
from folio.core.tokenizer.vision_inputs import ImagePreprocessor, load_processor
from folio.testing.models import write_tiny_qwen25_vl_model
from tests.folio.test_vision import IMAGES, QUESTIONS, SYSTEM, data_url, greedy_reference, image_runs, picture

ENGINE = {"dtype": "float32", "quantization": "none", "num_kv_blocks": 96, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# a 50 x 40 picture (height x width): 48 x 40 pixels, 12 x 10 patches of 4, merged 2 x 2: 30
# placeholders; a 30 x 20 one: 32 x 16 pixels, 8 x 4 patches: 8
PICTURES = [IMAGES[0], picture(3).resize((20, 30)), IMAGES[1]]
PLACEHOLDERS = [30, 8, 30]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_qwen25_vl_model(tmp_path_factory.mktemp("tiny-qwen25vl"), smollm_tokenizer_dir)


@pytest.fixture(scope="module")
def reference(qwen_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval(), \
        load_processor(qwen_dir)


def messages(question: str, images: list, system: bool = False, urls: bool = True) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} if urls else {"type": "image"}
             for im in images]
    return msgs + [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]


def reference_inputs(processor, question: str, images: list, system: bool = False):
    text = processor.apply_chat_template(messages(question, images, system, urls=False), add_generation_prompt=True)
    return processor(images=images or None, text=text, return_tensors="pt", add_special_tokens=False)


def reference_tokens(reference, question: str, images: list, system: bool = False, max_new_tokens: int = 10):
    """transformers' greedy tokens and prompt ids, the processor's own chat template and inputs."""
    model, processor = reference
    inputs = reference_inputs(processor, question, images, system)
    return greedy_reference(model, inputs, max_new_tokens)


def test_mrope_positions_equal_get_rope_index(qwen_dir, reference):
    model, processor = reference
    pre = ImagePreprocessor(qwen_dir, model.config.to_dict())
    inputs = reference_inputs(processor, QUESTIONS[1], PICTURES[:2])
    text = processor.apply_chat_template(messages(QUESTIONS[1], PICTURES[:2], urls=False), add_generation_prompt=True)
    ids, images = pre.process(text, [png(im) for im in PICTURES[:2]], add_special_tokens=False)
    assert ids == inputs["input_ids"][0].tolist() and [im.length for im in images] == PLACEHOLDERS[:2]
    want, deltas = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs["image_grid_thw"])
    layout = ImageLayout.of(images, model.config.vision_config.spatial_merge_size)
    got, is_image = layout.positions(np.arange(len(ids)))
    assert np.array_equal(got, want[:, 0].numpy()) and is_image.sum() == sum(PLACEHOLDERS[:2])
    assert layout.rope_delta == int(deltas[0, 0]) < 0  # 38 placeholders over 6 + 4 positions
    # decodes: the cache index plus the delta, as transformers' compute_3d_position_ids
    after, _ = layout.positions(np.arange(len(ids), len(ids) + 3))
    assert np.array_equal(after, np.broadcast_to(np.arange(len(ids), len(ids) + 3) + int(deltas[0, 0]), (3, 3)))


def test_processor_loads_from_either_layout(qwen_dir, tmp_path):
    """transformers 5's processor_config.json (the writer's) and the hub's older
    preprocessor_config.json give the same processor, built without its video half."""
    import json
    import shutil
    from pathlib import Path

    for f in Path(qwen_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "config")):
            shutil.copy(f, tmp_path / f.name)
    nested = json.loads((Path(qwen_dir) / "processor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**nested["image_processor"], "processor_class": nested["processor_class"]}))
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n"
    outs = [load_processor(folder)(text=text, images=[PICTURES[1]], return_tensors="np")
            for folder in (qwen_dir, tmp_path)]
    assert outs[0]["input_ids"].tolist() == outs[1]["input_ids"].tolist()
    assert np.array_equal(outs[0]["pixel_values"], outs[1]["pixel_values"])
    assert outs[0]["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert type(load_processor(tmp_path)).__mro__[1].__name__ == "Qwen2_5_VLProcessor"


def png(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_greedy_text_equals_transformers_batched_and_chunked(qwen_dir, reference):
    # 8 tokens a step: an image's 30 placeholders span four or five steps
    llm = LLM(qwen_dir, max_num_batched_tokens=8, **ENGINE)
    cases = [(q, [im]) for q in QUESTIONS for im in PICTURES[:2]] + [(QUESTIONS[2], PICTURES[1::-1]),
                                                                     (QUESTIONS[1], [])]  # and text alone
    outs = llm.chat([messages(q, ims) for q, ims in cases], GREEDY, use_tqdm=False)
    image_token = llm.engine.tokenizer.images.image_token_id
    for out, (q, ims) in zip(outs, cases):
        want, prompt = reference_tokens(reference, q, ims)
        assert out.prompt_token_ids == prompt  # the processor's expansion of <|image_pad|>
        assert image_runs(prompt, image_token) == [PLACEHOLDERS[PICTURES.index(im)] for im in ims]
        assert list(out.outputs[0].token_ids) == want, (q, [PICTURES.index(im) for im in ims])
    # the tower ran once per image of each request, not once per chunk
    assert llm.engine.core.runner.image_inputs.num_encoded == len(cases)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the image matters
    # the image token written in a prompt, the processor's own expansion
    want, prompt = reference_tokens(reference, QUESTIONS[0], [PICTURES[1]])
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + QUESTIONS[0] \
        + "<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": PICTURES[1]}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt and list(out.outputs[0].token_ids) == want


def test_batch_invariant_mode_with_preemption_keeps_the_text(qwen_dir, reference):
    # 8 blocks of 16 for four requests of 24-70 prompt + 24 output tokens: some are preempted and recomputed
    tight = LLM(qwen_dir, **{**ENGINE, "num_kv_blocks": 8, "max_num_batched_tokens": 16, "batch_invariant": True})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cases = [(QUESTIONS[0], [PICTURES[0]]), (QUESTIONS[1], [PICTURES[1]]), (QUESTIONS[2], PICTURES[:2]),
             (QUESTIONS[0], [PICTURES[2]])]
    outs = tight.chat([messages(q, ims) for q, ims in cases], params, use_tqdm=False)
    assert tight.engine.core.scheduler.counters["num_preemptions"] > 0
    for out, (q, ims) in zip(outs, cases):
        assert list(out.outputs[0].token_ids) == reference_tokens(reference, q, ims, max_new_tokens=24)[0]


def test_prefix_cache_tells_images_apart(qwen_dir, reference):
    cached = LLM(qwen_dir, max_num_batched_tokens=256, **ENGINE)
    block, question = 16, QUESTIONS[2] + " Answer in a few words."  # a text after the image longer than a block

    def chat(image):
        return cached.chat(messages(question, [image], system=True), GREEDY, use_tqdm=False)[0]

    first = chat(PICTURES[0])
    offset = first.prompt_token_ids.index(cached.engine.tokenizer.images.image_token_id)
    assert offset > block  # the system turn fills a whole block before the image
    other = chat(PICTURES[2])  # the same size: the same tokens, only the pixels differ
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    # the blocks before the image are shared, none from the one holding its first placeholder on
    assert other.num_cached_tokens == offset // block * block
    again = chat(PICTURES[0])
    # the same image: every full block is a hit (the last prompt token is always computed), past the image
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // block * block >= offset + PLACEHOLDERS[0]
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids) \
        == reference_tokens(reference, question, [PICTURES[0]], system=True)[0]


def test_speculative_decoding_is_refused_at_start(qwen_dir):
    with pytest.raises(ValueError, match="speculative decoding does not run qwen2_5_vl"):
        LLM(qwen_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **ENGINE)


def test_a_plan_whose_image_grid_does_not_hold_its_patches_is_refused(qwen_dir, reference):
    import msgspec

    from folio.core.executor.runtime.plan_check import InvalidPlan
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig
    from folio.shared.messages import NewRequestData, StepPlan
    from tests.executor.toy_driver import generate

    model, processor = reference
    pre = ImagePreprocessor(qwen_dir, model.config.to_dict())
    text = processor.apply_chat_template(messages(QUESTIONS[0], [PICTURES[1]], urls=False), add_generation_prompt=True)
    ids, images = pre.process(text, [png(PICTURES[1])], add_special_tokens=False)
    runner = ModelRunner(RuntimeConfig(device="cpu", dtype="float32", num_kv_blocks=16, block_size=16), qwen_dir)
    bad = msgspec.structs.replace(images[0], grid=[1, 8, 8])  # 64 patches named, 32 sent
    plan = StepPlan(step_id=0, new_reqs=[NewRequestData(req_id="bad", token_ids=ids, num_prompt_tokens=len(ids),
                                                        sampling=GREEDY, block_ids=[0, 1, 2], images=[bad])],
                    num_scheduled_tokens={"bad": len(ids)})
    with pytest.raises(InvalidPlan, match=r"patch grid \[1, 8, 8\] does not hold its 32 patches"):
        runner.execute(plan)
    runner.execute(StepPlan(step_id=1, finished_req_ids=["bad"]))
    # the runner goes on: the same image with its own grid gives transformers' tokens
    want = reference_tokens(reference, QUESTIONS[0], [PICTURES[1]], max_new_tokens=4)[0]
    assert generate(runner, [ids], SamplingParams(temperature=0, max_tokens=4), images=[images]) == [want]

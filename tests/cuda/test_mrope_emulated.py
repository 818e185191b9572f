"""M-RoPE (Qwen2.5-VL) on the kernel backend's fused RoPE + KV write (emulated kernels on the
CPU): the kernel reads the RoPE tables by position, image tokens' rows in the tables' tail, and
greedy tokens equal transformers' ``generate`` for images of two sizes, in chunks that split an
image's placeholders."""

from __future__ import annotations

import io

import pytest
import torch

from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
from folio.core.executor.runtime.runner import ModelRunner
from folio.core.tokenizer.vision_inputs import ImagePreprocessor, load_processor
from folio.shared.config import RuntimeConfig
from folio.shared.sampling import SamplingParams
from folio.testing.models import write_tiny_qwen25_vl_model
from tests.executor.toy_driver import generate
from tests.folio.test_vision import IMAGES, picture


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smollm_tokenizer_dir):
    # head_dim 64 (a built kernel instance), GQA group 2
    return write_tiny_qwen25_vl_model(tmp_path_factory.mktemp("tiny-qwen25vl-h64"), smollm_tokenizer_dir,
                                      hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                      mrope_section=(8, 12, 12))


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_on_the_fused_rope(qwen_dir, emu_launcher):
    from transformers import Qwen2_5_VLForConditionalGeneration

    processor = load_processor(qwen_dir)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    pre = ImagePreprocessor(qwen_dir, reference.config.to_dict())
    prompts, images, want = [], [], []
    for question, picture_ in [("What is this?", IMAGES[0]), ("Describe it.", picture(3).resize((20, 30)))]:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(msgs, add_generation_prompt=True)
        ids, ims = pre.process(text, [png(picture_)], add_special_tokens=False)
        inputs = processor(images=[picture_], text=text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = reference.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        prompts.append(ids)
        images.append(ims)
        want.append(out[0, len(ids):].tolist())
    config = RuntimeConfig(device="cpu", dtype="float32", num_kv_blocks=24, block_size=8, attention_backend="torch",
                           max_num_batched_tokens=64)
    runner = ModelRunner(config, qwen_dir)
    runner.backend = KernelAttentionBackend(emu_launcher, runner.dtype, partition_size=8)
    got = generate(runner, prompts, SamplingParams(temperature=0.0, max_tokens=6), chunk_size=12, images=images)
    assert got == want
    launched = {name.split("<")[0] for name, _, _ in emu_launcher.launches}
    assert "folio::rope_write_kv" in launched
    assert runner.backend.layer_ops.num_fallbacks == 0  # every layer op on the kernels, image rows too

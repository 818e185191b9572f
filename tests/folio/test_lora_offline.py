"""The offline API with LoRA adapters: ``LLM(..., enable_lora=True)`` and ``generate(...,
lora_request=LoRARequest(name, id, path))`` (one for every prompt, or a list per prompt) give each
prompt its adapter's greedy tokens, as ``peft``'s merged model in transformers gives them; a bad
adapter raises before anything is queued."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, LoRARequest, SamplingParams
from folio.testing.peft_adapters import write_peft_adapter
from folio.testing.models import write_tiny_chat_model

import peft  # noqa: E402  (a test extra: a missing peft fails, never skips)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm_tokenizer_dir):
    root = tmp_path_factory.mktemp("lora-offline")
    base = write_tiny_chat_model(root / "base", smollm_tokenizer_dir)
    adapters = {name: write_peft_adapter(base, root / name, 8, targets, alpha=16, seed=10 + i)
                for i, (name, targets) in enumerate({"a": ["q_proj", "v_proj"], "b": ["o_proj", "down_proj"]}.items())}
    return base, adapters


def merged_greedy(base, adapter, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.inference_mode():
        return model.eval().generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def test_generate_with_lora_requests(setup):
    base, adapters = setup
    llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[17, 523, 88, 1024, 7], [301, 42, 9, 77, 5000, 12]]
    a, b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params, use_tqdm=False,
                        lora_request=[a, b, None, a])
    expected = [merged_greedy(base, adapters[n] if n else None, p, 6)
                for n, p in zip(["a", "b", None, "a"], prompts * 2)]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected[0] != expected[2] and expected[1] != merged_greedy(base, None, prompts[1], 6)  # they bite
    one = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False, lora_request=b)
    assert one[0].outputs[0].token_ids == expected[1]
    with pytest.raises(ValueError, match="not a folder"):
        llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False,
                     lora_request=LoRARequest("c", 3, adapters["a"] + "-missing"))
    with pytest.raises(ValueError, match="LoRA requests for"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=[a])

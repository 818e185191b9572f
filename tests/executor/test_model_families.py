"""Every model family against transformers in fp32, on tiny random-weight checkpoints written from
its own config class with its features switched on (per-head and whole-projection q/k norms,
q/k/v clipping that bites, an odd number of experts with top-k > 1, ``norm_topk_prob`` both
ways, a shared expert, a dense layer among sparse ones). Each run goes through the real
scheduler (``EngineCore``): one prompt; 8 concurrent prompts under a small token budget (chunked
prefill); a prompt whose prefix is already cached; preemption on a small pool; n-gram
speculative decoding; the C kernel backend (Qwen3, Qwen3-MoE, Gemma 2, Phi-3) and, for Qwen3,
Gemma 2 and Phi-3, tensor parallel 2. The attention variants bite: sliding windows of 6-7
positions (Mistral and Phi-3 on every layer, Qwen2 from ``max_window_layers``, Gemma 2 on every
other layer, Gemma 3 on two local layers to one global, with their own RoPE base),
soft-caps of 3 and 4, a query scale that is not head_dim's, Phi-3's LongRoPE factors.
Greedy tokens must be the reference's argmax at every position and the top-5 logprobs its top 5,
on the default path and with ``batch_invariant`` (the ``batch_invariant`` fixture runs both).
Then the registry's reading of windows and its refusals."""

from __future__ import annotations

import pytest
import torch

from folio.core.engine import EngineCore
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import EngineRequest
from folio.shared.sampling import SamplingParams
from folio.testing.models import write_tiny_model

MOE = dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32)
FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=16)),
    "mixtral": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=48)),
    "qwen3_moe-norm": ("qwen3_moe", dict(head_dim=16, norm_topk_prob=True, **MOE)),
    # layer 1 dense (mlp_only_layers), routing weights not renormalised
    "qwen3_moe-raw": ("qwen3_moe", dict(head_dim=16, norm_topk_prob=False, mlp_only_layers=[1], **MOE)),
    "qwen2_moe-shared": ("qwen2_moe", dict(norm_topk_prob=False, shared_expert_intermediate_size=48, **MOE)),
    "olmoe": ("olmoe", dict(num_experts=5, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=True,
                            clip_qkv=1.5, eos_token_id=1, pad_token_id=0)),
    # windows of 6-7 positions against prompts of 5..26 tokens and 12 more generated
    "mistral-window": ("mistral", dict(sliding_window=7)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),  # layer 1
    # layer 0 windowed, layer 1 global; both soft-caps bite; the query scale is not head_dim's
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=6, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                              query_pre_attn_scalar=24, tie_word_embeddings=True)),
    # two local layers (base 10k, window 6) to one global (base 1M); q/k norms
    "gemma3": ("gemma3_text", dict(head_dim=16, num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=32,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   tie_word_embeddings=True)),
    # fused qkv_proj/gate_up_proj; LongRoPE (short factors within 64 positions); window 7 on every layer
    "phi3": ("phi3", dict(sliding_window=7, original_max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                          bos_token_id=2, rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                               short_factor=[1.0 + 0.4 * i for i in range(8)],
                                                               long_factor=[2.0 + 0.7 * i for i in range(8)]))),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
PROMPTS = [[(7 * i + 13 * j) % 127 + 1 for j in range(5 + 3 * i)] for i in range(8)]  # 5..26 tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def run(runner: ModelRunner, prompts, budget: int = 256, core: EngineCore | None = None, params=GREEDY):
    """Each prompt's (tokens, logprobs, cached prompt tokens) through the scheduler and the runner."""
    core = core or EngineCore(runner, max_num_seqs=8, max_num_batched_tokens=budget)
    out = {f"r{i}": ([], [], 0) for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        assert not core.add_request(EngineRequest(req_id=f"r{i}", prompt_token_ids=p, sampling=params))
    while core.has_work():
        batch = core.step()
        for d in batch.all_deltas() if batch else ():
            assert d.finish_reason != "error", d.error
            tokens, lps, cached = out[d.req_id]
            out[d.req_id] = (tokens + d.token_ids, lps + (d.logprobs or []), max(cached, d.num_cached_tokens))
    return list(out.values())


def check_against_reference(hf, prompt, tokens, logprobs):
    """Our greedy tokens are the reference's argmax given the same prefix; top-5 ids and logprobs
    match (``logprobs`` None: tokens only)."""
    assert len(tokens) == GREEDY.max_tokens and len(logprobs if logprobs is not None else tokens) == len(tokens)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    top = ref.topk(5)
    assert tokens == ref.argmax(-1).tolist()
    for i, lp in enumerate(logprobs or []):
        assert lp.token_id == tokens[i] and lp.rank == 1
        assert lp.top_token_ids == top.indices[i].tolist()
        assert lp.top_logprobs == pytest.approx(top.values[i].tolist(), abs=1e-4)


def test_one_prompt(family, batch_invariant):
    path, hf = family
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, block_size=8, batch_invariant=batch_invariant), path)
    assert runner.backend.name == ("cpu" if batch_invariant else "torch")
    ((tokens, lps, _),) = run(runner, [PROMPTS[5]])
    check_against_reference(hf, PROMPTS[5], tokens, lps)


def test_eight_prompts_chunked_under_a_small_budget(family, batch_invariant):
    path, hf = family
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=96, block_size=8, batch_invariant=batch_invariant), path)
    for prompt, (tokens, lps, _) in zip(PROMPTS, run(runner, PROMPTS, budget=16)):
        check_against_reference(hf, prompt, tokens, lps)


def test_prefix_cache_hit(family, batch_invariant):
    path, hf = family
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, block_size=4, batch_invariant=batch_invariant), path)
    core = EngineCore(runner, max_num_seqs=8, max_num_batched_tokens=64)
    shared = PROMPTS[7][:20]
    first, second = shared + [3, 4], shared + [9, 8, 7]
    (tokens, lps, cached), = run(runner, [first], core=core)
    check_against_reference(hf, first, tokens, lps)
    (tokens, lps, cached), = run(runner, [second], core=core)
    assert cached == 20  # five whole blocks of the shared prefix
    check_against_reference(hf, second, tokens, lps)


def test_preemption_on_a_small_pool(family, batch_invariant):
    from folio.core.executor.model.registry import model_spec

    path, hf = family
    # 8 prompts want up to 10 blocks each; a model windowed on every layer gives back the blocks
    # behind its window (about 3 held in decode), so it gets a pool of 7 and chunks of 16
    windowed = all(model_spec(hf.config).layer_windows)
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=7 if windowed else 24, block_size=4,
                                       batch_invariant=batch_invariant), path)
    core = EngineCore(runner, max_num_seqs=8, max_num_batched_tokens=16 if windowed else 64)
    for prompt, (tokens, lps, _) in zip(PROMPTS, run(runner, PROMPTS, core=core)):
        check_against_reference(hf, prompt, tokens, lps)
    assert core.scheduler.counters["num_preemptions"] > 0


def test_ngram_speculative_decoding(family, batch_invariant):
    path, hf = family
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=96, block_size=8, speculative_model="ngram",
                                       num_speculative_tokens=3, batch_invariant=batch_invariant), path)
    core = EngineCore(runner, max_num_seqs=8, max_num_batched_tokens=64)
    loops = [p + p[:6] for p in PROMPTS[2:6]]  # a repeated stretch for the proposer to match
    plain = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens)  # (logprob requests never speculate)
    for prompt, (tokens, _, _) in zip(loops, run(runner, loops, core=core, params=plain)):
        check_against_reference(hf, prompt, tokens, None)
    assert core.scheduler.counters["num_spec_draft_tokens"] > 0


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe-norm", "gemma2", "phi3"])
def test_the_cpu_kernel_backend(tmp_path, name, batch_invariant):
    """The C kernels' fused RoPE + KV write rotates the q/k-normed projections, their SiLU x gate
    runs each expert's rows, their GeGLU Gemma 2's MLP, and their decode attention the windows and
    the soft-cap (no fallback)."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = FAMILIES[name]
    path = write_tiny_model(tmp_path / name, model_type, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, block_size=8, attention_backend="cpu",
                                       batch_invariant=batch_invariant), path)
    assert runner.backend.name == "cpu"
    for prompt, (tokens, lps, _) in zip(PROMPTS[:3], run(runner, PROMPTS[:3], budget=16)):
        check_against_reference(hf, prompt, tokens, lps)
    assert runner.backend.layer_ops.num_fallbacks == 0


def test_qwen3_over_two_ranks(tmp_path, batch_invariant):
    """Tensor parallel 2 over gloo: each rank its heads, the per-head q/k norms replicated."""
    over_two_ranks(tmp_path, "qwen3", batch_invariant)


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_over_two_ranks(tmp_path, name, batch_invariant):
    """Gemma 2: windows, soft-caps (the final one after the logits' gather) and the sandwich norms
    on each rank's heads; Phi-3: each rank's rows of the fused qkv_proj and gate_up_proj."""
    over_two_ranks(tmp_path, name, batch_invariant)


def over_two_ranks(tmp_path, name, batch_invariant):
    from transformers import AutoModelForCausalLM

    from folio.core.executor.runtime.workers import ParallelRunner

    model_type, overrides = FAMILIES[name]
    path = write_tiny_model(tmp_path / name, model_type, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    failures: list[str] = []
    config = RuntimeConfig(model=path, device="cpu", dtype="float32", quantization="none", block_size=8,
                           num_kv_blocks=96, tensor_parallel_size=2, batch_invariant=batch_invariant)
    runner = ParallelRunner(config, path, on_failure=failures.append)
    try:
        for prompt, (tokens, lps, _) in zip(PROMPTS[:4], run(runner, PROMPTS[:4], budget=16)):
            check_against_reference(hf, prompt, tokens, lps)
    finally:
        runner.close()
    assert not failures


def test_an_unsupported_model_names_what_runs(tmp_path):
    path = write_tiny_model(tmp_path / "gemma", "gemma", head_dim=16, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match=r"unsupported model_type 'gemma'.*folio runs llama.*qwen3 .*mixtral"):
        ModelRunner(RuntimeConfig(num_kv_blocks=16), path)


@pytest.mark.parametrize("options, message", [
    (dict(quantization="awq"), "run quantized as int8 or int4 only"),
    (dict(device="cuda"), "run on the CPU only"),
])
def test_moe_refuses_what_it_cannot_run_yet(tmp_path, options, message):
    from folio.core.executor.model.loader import load_model

    path = write_tiny_model(tmp_path / "mixtral", "mixtral", num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, torch.device(options.get("device", "cpu")), options.get("quantization", "none"))


@pytest.mark.parametrize("config_name, options, windows", [
    ("LlamaConfig", {}, (0, 0, 0, 0)),
    ("MistralConfig", dict(sliding_window=5), (5, 5, 5, 5)),
    ("Phi3Config", dict(sliding_window=5), (5, 5, 5, 5)),
    ("Qwen2Config", dict(sliding_window=5), (0, 0, 0, 0)),  # no use_sliding_window: no window
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=2), (0, 0, 5, 5)),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1), (0, 5, 5, 5)),
    ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window=5), (5, 5, 5, 5)),
    ("Gemma2Config", dict(sliding_window=5), (5, 0, 5, 0)),
    ("Gemma3TextConfig", dict(sliding_window=5, sliding_window_pattern=2), (5, 0, 5, 0)),
])
def test_sliding_windows_are_read_as_transformers_applies_them(config_name, options, windows):
    import transformers

    from folio.core.executor.model import registry

    config = getattr(transformers, config_name)(num_hidden_layers=4, **options)
    assert registry.model_spec(config).layer_windows == windows


def test_the_multimodal_gemma3_runs_its_text_config_as_gemma3_text_does():
    """``Gemma3ForConditionalGeneration``: the text model's spec (windows, Gemma's norms and scale)
    from its text config, the head tied as the composite config says, its images attended both ways."""
    import transformers

    from folio.core.executor.model import registry

    text = dict(num_hidden_layers=6, sliding_window=64, head_dim=16)
    config = transformers.Gemma3Config(architectures=["Gemma3ForConditionalGeneration"], text_config=text,
                                       tie_word_embeddings=False)
    spec = registry.model_spec(config)
    text_spec = registry.model_spec(transformers.Gemma3TextConfig(**text))
    assert spec.model_type == "gemma3" and spec.model_type in registry.VISION_MODEL_TYPES
    assert spec.layer_windows == text_spec.layer_windows == (64,) * 5 + (0,)  # five local layers to one global
    assert (spec.embed_scale, spec.norm_offset, spec.head_dim) == (text_spec.embed_scale, 1.0, 16)
    assert not spec.tie_word_embeddings and text_spec.tie_word_embeddings
    assert registry.family_for(config).images_attend_both_ways
    # the tokenizer marks the images of those families for the scheduler (``ImageInput.both_ways``)
    from folio.core.tokenizer.vision_inputs import BOTH_WAYS_MODEL_TYPES

    assert set(BOTH_WAYS_MODEL_TYPES) == {t for f in registry.FAMILIES if getattr(f, "images_attend_both_ways", False)
                                          for t in f.model_types}


def test_longrope_beyond_the_original_length_rotates_as_transformers():
    """Positions from original_max_position_embeddings on take the long factors (those
    transformers gives them when the sequence is that long), the ones before the short factors."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from folio.core.executor.model.layers import rope_cos_sin

    _, overrides = FAMILIES["phi3"]
    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512, **overrides)
    cos, sin = rope_cos_sin(config, 512, torch.float32)
    x = torch.zeros(1, 1, 16)
    for positions in (torch.arange(0, 64), torch.arange(0, 200)):
        ref_cos, ref_sin = Phi3RotaryEmbedding(config)(x, positions[None])
        tail = positions >= (64 if len(positions) > 64 else 0)  # the long factors apply to these
        assert torch.equal(cos[positions][tail], ref_cos[0][tail]) and torch.equal(sin[positions][tail], ref_sin[0][tail])
    assert not torch.equal(cos[:64], Phi3RotaryEmbedding(config)(x, torch.arange(0, 200)[None])[0][0, :64])

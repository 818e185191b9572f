"""GGUF checkpoints of every architecture folio reads, written by llama.cpp's own converter, against
the safetensors folders they were converted from, and read back by transformers' GGUF loader.

Each case writes a tiny random-weight model with its ``transformers`` config class and converts it
with ``convert_hf_to_gguf.py`` from the pinned llama-cpp-python sdist (``folio.testing.gguf_models``:
downloaded and extracted once per machine into the folio cache). folio loads both; the GGUF must
give the same spec, the same weights and the same logits (F32: exact up to the fp32 metadata's
rounding). transformers reads the same file: its weights, run with the metadata it reads (the
folder's config where it drops some), give folio's logits. One quantized file (the converter's
output with Q4_0 attention and Q4_1 MLP blocks, quantized by gguf-py's reference quantizer; a
permuted llama and a fused Phi-3) must load its projections into the int4 path unchanged and match a
folder holding its dequantized weights.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from folio.core.executor.kernels.attention import AttentionMetadata
from folio.core.executor.model.loader import load_model, read_checkpoint
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.testing.gguf_models import SMOLLM_VOCAB, convert_tiny_models
from folio.testing.llamacpp import llamacpp_source
from folio.testing.models import write_tiny_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece", reason="llama.cpp's converter reads the tiny models' tokenizer.model with it")

MOE = dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=6, tie_word_embeddings=True)
CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    # Llama 3's RoPE scaling, which llama.cpp writes as a rope_freqs tensor of divisors
    "llama3-rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mixtral": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=64,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("qwen2", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})),
    "qwen3": ("qwen3", dict(head_dim=24)),
    # the converter reads these only with a BPE tokenizer it knows (SmolLM2's): its vocabulary
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, norm_topk_prob=True, vocab_size=SMOLLM_VOCAB, **MOE)),
    "qwen2_moe": ("qwen2_moe", dict(norm_topk_prob=False, shared_expert_intermediate_size=48,
                                    vocab_size=SMOLLM_VOCAB, **MOE)),
    # llama.cpp scales Gemma's queries by head_dim ** -0.5 (hidden / heads for the 27B models) and
    # ties the head; windows shorter than the prompt and soft-caps that bite
    "gemma2": ("gemma2", dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0, **GEMMA)),
    # six layers: five local, one global (llama.cpp's fixed pattern); its own global RoPE scaling
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, rope_parameters={
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **GEMMA)),
    # LongRoPE past an original context of 8 (the factors as llama.cpp's tensors), a window of 6
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=8, sliding_window=6, pad_token_id=0,
                                   eos_token_id=2, rope_parameters={
                                       "rope_type": "longrope", "rope_theta": 1e4,
                                       "long_factor": [1.0 + i / 4 for i in range(8)],
                                       "short_factor": [1.0 + i / 16 for i in range(8)]})),
}
ARCH = {"llama": "LLAMA", "mixtral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "qwen2_moe": "QWEN2MOE",
        "qwen3_moe": "QWEN3MOE", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3", "phi3": "PHI3"}
# what transformers' GGUF loader (5.x) does not read from llama.cpp's metadata: it gets the folder's
TRANSFORMERS_DROPS = {
    "llama3-rope": "Llama 3's RoPE scaling (the rope_freqs divisors)",
    "qwen2": "the linear RoPE scaling",
    "gemma2": "the soft-caps and query_pre_attn_scalar",
    "gemma3": "the soft-caps' absence, query_pre_attn_scalar and the global RoPE scaling",
    "phi3-longrope": "the LongRoPE factors and the sliding window",
}
# and the files it cannot load at all
TRANSFORMERS_CANNOT = {
    "mixtral": "it reads a llama GGUF with experts as a dense LlamaForCausalLM",
    "qwen3": "it ignores attention.key_length (head_dim 24, not hidden / heads)",
    "qwen2_moe": "it ignores expert_feed_forward_length (its experts' shapes mismatch)",
    "qwen3_moe": "it ignores expert_feed_forward_length (its experts' shapes mismatch)",
}
PROMPT = [3, 17, 99, 5, 42, 8, 8, 61, 120, 7, 33, 2, 90]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case)`` -> (the safetensors folder, llama.cpp's F32 GGUF of it): every case
    converted at the first call, in one converter process."""
    try:
        llamacpp_source(log=subprocess.DEVNULL)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"the llama-cpp-python sdist (llama.cpp's converter) could not be downloaded: {e}")
    made: dict[str, tuple[str, Path]] = {}
    errors: dict[str, str] = {}

    def convert(case: str) -> tuple[str, Path]:
        if not made:
            for name, (model_type, overrides) in CASES.items():
                folder = write_tiny_model(tmp_path_factory.mktemp(name) / "hf", model_type, **overrides)
                made[name] = folder, Path(folder).parent / f"{name}.gguf"
            errors.update(convert_tiny_models(dict(made.values())))
        folder, path = made[case]
        if str(path) in errors:
            pytest.fail(f"llama.cpp's converter failed on {case}:\n{errors[str(path)][-3000:]}", pytrace=False)
        return folder, path

    return convert


def requantize(src: Path, dst: Path, choose) -> Path:
    """``src`` rewritten with each 2-D tensor ``choose(name)`` names quantized by gguf-py's reference
    quantizer (llama.cpp's block formats); the metadata and other tensors copied."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        array = np.array(t.data)
        qtype = choose(t.name) if array.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(t.name, array)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ---------------------------------------------------------------------------- checks
def prompt_logits(runner: ModelRunner, prompt: list[int] = PROMPT) -> torch.Tensor:
    n = len(prompt)
    meta = AttentionMetadata.build([n], [n], [[0, 1]], torch.arange(n), 8)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), torch.arange(n), runner.pool.kv_caches, meta, runner.backend)
        return runner.model.compute_logits(hidden)


def runner_for(path, quantization: str = "none") -> ModelRunner:
    return ModelRunner(RuntimeConfig(num_kv_blocks=8, block_size=8, quantization=quantization), str(path))


def same_spec(a, b) -> None:
    """Equal specs; the norm epsilon went through fp32 metadata."""
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(a, rms_norm_eps=0.0) == dataclasses.replace(b, rms_norm_eps=0.0)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "gemma2" else c  # gemma2: 8 s
                                  for c in sorted(CASES)])
def test_gguf_loads_to_the_folders_weights_and_logits(case, converted):
    folder, path = converted(case)
    cpu = torch.device("cpu")
    ours, theirs = load_model(path, torch.float32, cpu), load_model(folder, torch.float32, cpu)
    same_spec(ours.spec, theirs.spec)
    assert type(ours) is type(theirs)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    torch.testing.assert_close(prompt_logits(runner_for(path)), prompt_logits(runner_for(folder)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_reads_the_gguf_to_folios_logits(case, converted):
    """transformers' own GGUF reader (its names, its un-permuting, Gemma's ``-1``) on the same file:
    its weights are the folder's, and its model gives the logits folio gives from the GGUF. Where it
    drops metadata, its weights run under the folder's config. LongRoPE: a prompt within the original
    context (beyond it, transformers rotates every position with the long factors, llama.cpp and folio
    only the positions past it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if case in TRANSFORMERS_CANNOT:
        pytest.skip(f"transformers' GGUF loader cannot read this file: {TRANSFORMERS_CANNOT[case]}")
    folder, path = converted(case)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    state = model.state_dict()
    assert state.keys() == reference.keys()
    for name, w in reference.items():  # Gemma's norms went through w + 1 - 1 in fp32
        torch.testing.assert_close(state[name], w, rtol=0, atol=1e-6, msg=name)
    if case in TRANSFORMERS_DROPS:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
        model.load_state_dict(state)
    prompt = PROMPT[:CASES[case][1].get("original_max_position_embeddings", len(PROMPT))]
    with torch.inference_mode():
        theirs = model.eval()(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prompt_logits(runner_for(path), prompt), theirs, rtol=1e-4, atol=1e-4)


# the MoE cases convert their larger checkpoints first: over 7 s each, in the full suite's tier
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.endswith("_moe") else c
                                  for c in sorted(CASES)])
def test_the_tokenizer_service_reads_the_gguf_as_transformers_does(case, converted):
    """folio's tokenizer of a GGUF (the class of the file's model type, told, so that transformers does not
    parse the whole file for its config) is AutoTokenizer's: the class, the ids, the special tokens, the chat
    template; and the config values the tokenizer service reads are transformers' own."""
    from transformers import AutoConfig, AutoTokenizer

    from folio.core.tokenizer.text import TextTokenizer

    _, path = converted(case)
    ours, theirs = TextTokenizer(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours.hf) is type(theirs)
    for text in ("the cat sat on a mat", "Hello, world! 123", "  spaced\nlines\t"):
        assert ours.hf.encode(text) == theirs.encode(text)
    assert (ours.hf.bos_token_id, ours.hf.eos_token_id, len(ours.hf)) == (theirs.bos_token_id, theirs.eos_token_id,
                                                                            len(theirs))
    assert ours.hf.chat_template == theirs.chat_template
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.max_model_len == config.max_position_embeddings


@pytest.mark.parametrize("case", ["llama-tied", "phi3-longrope"])
def test_quantized_gguf_serves_its_blocks_through_the_int4_path(case, converted, tmp_path):
    """Q4_0 attention and Q4_1 MLP projections (F32 embeddings and norms), in a llama (q/k rows
    permuted) and a Phi-3 (q/k/v and gate/up fused): loaded dense it is the folder of its
    dequantized weights (un-permuted); ``auto`` serves it int4 with those very weights, close to
    the dense logits."""
    from safetensors.torch import load_file, save_file

    model_type = CASES[case][0]
    folder, converted_path = converted(case)
    folder = Path(folder)
    q4 = {"attn": gguf.GGMLQuantizationType.Q4_0, "ffn": gguf.GGMLQuantizationType.Q4_1}

    def kind(name):
        return q4.get(name.split(".")[2].split("_")[0]) if name.startswith("blk.") else None

    path = requantize(converted_path, tmp_path / "q4.gguf", kind)
    # the reference folder: each projection dequantized as llama.cpp would, then un-permuted
    c = json.loads((folder / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCH[model_type]], c["num_hidden_layers"])
    reader = gguf.GGUFReader(str(path))
    state = load_file(folder / "model.safetensors")
    for hf_name in list(state):
        t = next((t for t in reader.tensors if t.name == names.get_name(hf_name, try_suffixes=(".weight",))), None)
        if t is None or t.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        for proj, n_head in (("q_proj", c["num_attention_heads"]), ("k_proj", c["num_key_value_heads"])):
            if proj in hf_name and model_type == "llama":  # the inverse of permute: [head, i, half] -> [head, half, i]
                w = w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        assert w.shape == state[hf_name].shape and not torch.equal(w, state[hf_name])
        state[hf_name] = w
    reference = tmp_path / "dequantized"
    reference.mkdir()
    (reference / "config.json").write_text((folder / "config.json").read_text())
    save_file(state, reference / "model.safetensors")

    config, dense, method, quant = read_checkpoint(path)
    assert method == "int4" and set(quant) == {n for n in state if n.endswith("_proj.weight")}
    for name, w in quant.items():
        assert w.group_size == 32
        torch.testing.assert_close(w.dequantize(), state[name], rtol=0, atol=1e-6)  # the blocks, repacked
        assert torch.equal(dense[name], state[name])
    exact = prompt_logits(runner_for(reference))
    torch.testing.assert_close(prompt_logits(runner_for(path, "none")), exact, rtol=1e-5, atol=1e-5)
    int4 = runner_for(path, "auto")
    assert int4.model.quantization == "int4"
    got = prompt_logits(int4)
    # bf16 activations in the packed kernels: a few bf16 ulps of the logits' scale, on the top logits
    # (the int4 LM head recomputes its top 64 exactly; the tail of a 128-token vocabulary it does not)
    top = exact.topk(5, dim=-1)
    torch.testing.assert_close(got.gather(-1, top.indices), top.values, rtol=0, atol=3e-2 * exact.abs().max().item())
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "bloom.gguf"
    w = gguf.GGUFWriter(str(path), "bloom")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'bloom' is not supported"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_two_ranks_read_their_slices_of_a_mixtral_gguf(converted):
    """Tensor parallel 2 from the GGUF (each rank its heads of the permuted q/k rows, its half of every
    expert's rows and columns, read from the stacked 3-D tensors): the tokens and logprobs of one
    rank on the folder."""
    from folio.core.executor.runtime.workers import ParallelRunner
    from tests.executor.test_model_families import PROMPTS, run

    folder, path = converted("mixtral")
    path = str(path)
    failures: list[str] = []
    config = RuntimeConfig(model=path, device="cpu", dtype="float32", quantization="none", block_size=8,
                           num_kv_blocks=64, tensor_parallel_size=2)
    group = ParallelRunner(config, path, on_failure=failures.append)
    try:
        ours = run(group, PROMPTS[:2], budget=16)
    finally:
        group.close()
    assert not failures
    reference = run(runner_for(folder), PROMPTS[:2], budget=16)
    for (tokens, lps, _), (want, want_lps, _) in zip(ours, reference):
        assert tokens == want
        for lp, ref in zip(lps, want_lps):
            assert lp.top_token_ids == ref.top_token_ids
            assert lp.top_logprobs == pytest.approx(ref.top_logprobs, abs=1e-4)

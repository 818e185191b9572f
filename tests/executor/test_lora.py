"""Multi-LoRA against ``peft``: random adapters written by ``peft`` itself (non-zero A and B) on a
tiny Llama in fp32. Reading them (scaling, rsLoRA, refusals), the batched delta (``bgmv``/``sgmv``
against a per-row reference), the device slots' LRU, then the oracle: each adapter's greedy
tokens and top-5 logprobs from ``peft``'s merged model in transformers must be folio's, with
three adapters and the base model in one mixed batch through the real scheduler (``EngineCore``),
under preemption and with the prefix cache warm (shared within an adapter, never across), each on
the default path and with ``batch_invariant``."""

from __future__ import annotations

import json

import pytest
import torch

from folio.core.engine import EngineCore
from folio.core.executor.lora import LoRAError, LoRAManager, bgmv, load_peft_adapter, sgmv
from folio.core.executor.lora.adapters import projection_layout
from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.config import RuntimeConfig
from folio.shared.messages import EngineRequest
from folio.shared.sampling import SamplingParams
from folio.testing.peft_adapters import write_peft_adapter
from folio.testing.models import write_tiny_model

import peft  # noqa: E402  (a test extra: a missing peft fails, never skips)

# rank, target modules, rsLoRA, alpha
ADAPTERS = {
    "qv8": (8, ["q_proj", "v_proj"], False, 16),
    "attn16": (16, ["q_proj", "k_proj", "v_proj", "o_proj"], True, 32),
    "all64": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False, 32),
}


def write_adapter(base_path, out_dir, rank, targets, rslora, alpha, seed, std=0.3):
    return write_peft_adapter(base_path, out_dir, rank, targets, alpha=alpha, rslora=rslora, seed=seed, std=std)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_model(root / "base", "llama")
    adapters = {name: write_adapter(base, root / name, *spec, seed=i)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    return base, adapters


def spec_of(path):
    from transformers import AutoConfig

    from folio.core.executor.model.registry import model_spec

    return model_spec(AutoConfig.from_pretrained(path))


def test_reads_peft_adapters(tiny):
    base, adapters = tiny
    spec = spec_of(base)
    for name, (rank, targets, rslora, alpha) in ADAPTERS.items():
        adapter = load_peft_adapter(adapters[name], spec, max_rank=64)
        assert adapter.rank == rank
        assert adapter.scaling == pytest.approx(alpha / rank ** 0.5 if rslora else alpha / rank)
        fused = {("qkv_proj" if t[0] in "qkv" else "gate_up_proj" if t in ("gate_proj", "up_proj") else t)
                 for t in targets}
        assert {p for _, p in adapter.modules} == fused
        assert len(adapter.modules) == len(fused) * spec.num_layers


def test_refusals(tiny, tmp_path):
    base, adapters = tiny
    spec = spec_of(base)
    with pytest.raises(LoRAError, match="not a folder"):
        load_peft_adapter(tmp_path / "missing", spec, 64)
    with pytest.raises(LoRAError, match="above max_lora_rank 16"):
        load_peft_adapter(adapters["all64"], spec, 16)
    other = write_tiny_model(tmp_path / "wide", "llama", hidden_size=32)
    with pytest.raises(LoRAError, match="another model"):
        load_peft_adapter(adapters["qv8"], spec_of(other), 64)
    embed = write_adapter(base, tmp_path / "embed", 4, ["q_proj", "embed_tokens"], False, 8, seed=5)
    with pytest.raises(LoRAError, match="unsupported target"):
        load_peft_adapter(embed, spec, 64)
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((tmp_path / "embed" / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((tmp_path / "embed" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora"):
        load_peft_adapter(dora, spec, 64)


def reference_delta(x, a, b, indices, scales):
    y = torch.zeros(x.shape[0], b.shape[1])
    for t in range(x.shape[0]):
        s = int(indices[t])
        if s >= 0:
            y[t] = scales[s] * (x[t] @ a[s].T) @ b[s].T
    return y


def test_bgmv_and_sgmv_match_a_per_row_reference():
    torch.manual_seed(0)
    slots, r, d_in, d_out, n = 4, 8, 24, 40, 23
    a, b = torch.randn(slots, r, d_in), torch.randn(slots, d_out, r)
    a[2, 5:] = 0  # a rank-5 adapter in a rank-8 slot
    b[2, :, 5:] = 0
    x, scales = torch.randn(n, d_in), torch.tensor([0.5, 2.0, 1.0, 0.25])
    y0 = torch.randn(n, d_out)
    for indices in (torch.randint(-1, slots, (n,)), torch.full((n,), 3), torch.full((n,), -1),
                    torch.tensor([1] * 7 + [-1] * 6 + [2] * 10)):
        y = bgmv(y0.clone(), x, a, b, indices, scales)
        torch.testing.assert_close(y, y0 + reference_delta(x, a, b, indices, scales), rtol=1e-5, atol=1e-5)
    seg_starts, seg_slots = torch.tensor([0, 5, 6, 14, 23]), torch.tensor([2, -1, 0, 2])
    indices = torch.repeat_interleave(seg_slots, seg_starts.diff())
    y = sgmv(y0.clone(), x, a, b, seg_starts, seg_slots, scales)
    torch.testing.assert_close(y, y0 + reference_delta(x, a, b, indices, scales), rtol=1e-5, atol=1e-5)


def test_manager_slots_lru(tiny):
    base, adapters = tiny
    from folio.core.executor.model.loader import load_model

    model = load_model(base, torch.float32, torch.device("cpu"), "none")
    manager = LoRAManager(model, max_loras=2, max_lora_rank=64, max_cpu_loras=2)
    assert manager.attach() == 4 * 2
    for name, path in adapters.items():
        manager.add(name, path)
    assert manager.names() == list(adapters)
    assert manager.host_evictions == 1  # three adapters, two kept read
    slots = manager.activate(["qv8", "attn16"])
    assert sorted(slots.values()) == [0, 1] and manager.loads == 2
    assert manager.widths["qkv_proj"][slots["qv8"]] == 16 and manager.widths["o_proj"][slots["qv8"]] == 0
    assert manager.activate(["attn16"]) == {"attn16": slots["attn16"]} and manager.loads == 2
    again = manager.activate(["all64", "attn16"])  # qv8 is the least recently used: evicted
    assert again["all64"] == slots["qv8"] and manager.evictions == 1
    assert manager.host_loads == 6  # 3 added, then each activation read again (two kept read)
    a, b = manager.slot_weights[(1, "gate_up_proj")]
    assert a[slots["qv8"]].abs().sum() > 0 and b[slots["attn16"]].abs().sum() == 0
    with pytest.raises(LoRAError, match="more than max_loras"):
        manager.activate(list(adapters))
    with pytest.raises(LoRAError, match="no LoRA adapter named"):
        manager.activate(["nope"])
    with pytest.raises(LoRAError):
        manager.add("bad", "/nonexistent")
    assert manager.names() == list(adapters)
    manager.remove("all64")
    assert "all64" not in manager.names() and manager.free_slots == [again["all64"]]
    assert projection_layout(model) == projection_layout(spec_of(base))


# ---------------------------------------------------------------------- the oracle, through EngineCore
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5)
PROMPTS = [[(11 * i + 5 * j) % 127 + 1 for j in range(4 + 2 * i)] for i in range(16)]  # 4..34 tokens
CHOICES = [None, *ADAPTERS]  # request i runs CHOICES[i % 4]


@pytest.fixture(scope="module")
def references(tiny):
    """The base model and each adapter's merged model (peft's ``merge_and_unload``) in transformers."""
    from transformers import AutoModelForCausalLM

    base, adapters = tiny
    refs = {None: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()}
    for name, path in adapters.items():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        refs[name] = peft.PeftModel.from_pretrained(model, path).merge_and_unload().eval()
    return refs


def lora_runner(tiny, **config):
    base, adapters = tiny
    runner = ModelRunner(RuntimeConfig(**{"num_kv_blocks": 128, "block_size": 4, **config}), base, enable_lora=True,
                         max_loras=4, max_lora_rank=64, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    return runner


def run(core: EngineCore, prompts, adapters, params=GREEDY, prefix="r"):
    out = {f"{prefix}{i}": ([], [], 0) for i in range(len(prompts))}
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        assert not core.add_request(EngineRequest(req_id=f"{prefix}{i}", prompt_token_ids=p, sampling=params,
                                                  lora_name=a))
    while core.has_work():
        batch = core.step()
        for d in batch.all_deltas() if batch else ():
            assert d.finish_reason != "error", d.error
            tokens, lps, cached = out[d.req_id]
            out[d.req_id] = (tokens + d.token_ids, lps + (d.logprobs or []), max(cached, d.num_cached_tokens))
    return list(out.values())


def check(ref, prompt, tokens, logprobs):
    assert len(tokens) == GREEDY.max_tokens
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    top = logits.topk(5)
    assert tokens == logits.argmax(-1).tolist()
    for i, lp in enumerate(logprobs):
        assert lp.token_id == tokens[i] and lp.top_token_ids == top.indices[i].tolist()
        assert lp.top_logprobs == pytest.approx(top.values[i].tolist(), abs=1e-4)


def greedy_of(ref, prompt):
    with torch.inference_mode():
        return ref.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, len(prompt):].tolist()


def test_adapters_change_the_output(references):
    """Each adapter's merged model answers differently from the base (else the oracle proves nothing)."""
    for name in ADAPTERS:
        assert any(greedy_of(references[name], p) != greedy_of(references[None], p) for p in PROMPTS[:4])


def test_mixed_batch_of_three_adapters_and_the_base(tiny, references, batch_invariant):
    runner = lora_runner(tiny, batch_invariant=batch_invariant)
    assert runner.backend.name == ("cpu" if batch_invariant else "torch")
    steps = []

    class Core(EngineCore):
        def on_plan(self, out, plan):
            steps.append([r.lora_name for r, _ in out.scheduled])

    core = Core(runner, max_num_seqs=16, max_num_batched_tokens=64)
    choices = [CHOICES[i % 4] for i in range(len(PROMPTS))]
    results = run(core, PROMPTS, choices)
    for prompt, name, (tokens, lps, _) in zip(PROMPTS, choices, results):
        check(references[name], prompt, tokens, lps)
    assert runner.lora.loads == 3 and runner.lora.evictions == 0
    assert max(len(s) for s in steps) == 16 and any(len(set(s)) == 4 for s in steps)  # one mixed batch


def test_preemption_and_fewer_slots_than_adapters(tiny, references, batch_invariant):
    """A small pool preempts; two slots for three adapters: the scheduler admits at most two
    adapters at once and the slots turn over."""
    base, adapters = tiny
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=24, block_size=4, batch_invariant=batch_invariant), base,
                         enable_lora=True, max_loras=2,
                         max_lora_rank=64, lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    seen = []

    class Core(EngineCore):
        def on_plan(self, out, plan):
            seen.append({r.lora_name for r, _ in out.scheduled if r.lora_name})

    core = Core(runner, max_num_seqs=8, max_num_batched_tokens=32)
    prompts = PROMPTS[4:12]
    choices = [CHOICES[i % 4] for i in range(len(prompts))]
    results = run(core, prompts, choices)
    assert core.stats()["num_preemptions"] > 0
    assert max(len(s) for s in seen) == 2 and runner.lora.evictions > 0
    for prompt, name, (tokens, lps, _) in zip(prompts, choices, results):
        check(references[name], prompt, tokens, lps)


def test_prefix_cache_is_per_adapter(tiny, references, batch_invariant):
    runner = lora_runner(tiny, batch_invariant=batch_invariant)
    core = EngineCore(runner, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = PROMPTS[10]  # 24 tokens: 5 whole blocks before its last token
    order = ["qv8", "all64", None, "qv8", "all64", None]
    for k, name in enumerate(order):
        ((tokens, lps, cached),) = run(core, [prompt], [name], prefix=f"p{k}-")
        assert cached == (0 if k < 3 else 20), (k, name)  # shared within an adapter, never across
        check(references[name], prompt, tokens, lps)


def test_unknown_adapter_is_refused(tiny):
    runner = lora_runner(tiny)
    core = EngineCore(runner)
    (delta,) = core.add_request(EngineRequest(req_id="x", prompt_token_ids=[1, 2], sampling=GREEDY, lora_name="nope"))
    assert delta.finish_reason == "error" and delta.error_code == 404 and "nope" in delta.error


def prompt_logprobs(core: EngineCore, prompt, adapter, req_id):
    """Each prompt token's logprob given its prefix (teacher-forced: no generation to diverge)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    assert not core.add_request(EngineRequest(req_id=req_id, prompt_token_ids=prompt, sampling=params,
                                              lora_name=adapter))
    out = None
    while core.has_work():
        batch = core.step()
        for d in batch.all_deltas() if batch else ():
            assert d.finish_reason != "error", d.error
            out = d.prompt_logprobs if d.prompt_logprobs is not None else out
    return torch.tensor([lp.logprob for lp in out[1:]])


def test_int4_base_adds_the_delta_to_the_quantized_output(tiny, tmp_path, batch_invariant):
    """On an int4 base (``folio quantize``'s AWQ layout, the C kernels, bf16 activations) each
    adapter's prompt logprobs are those of the same weights dequantized in fp32 with the adapter,
    up to the bf16 rounding, and far from the dequantized base's without it."""
    from folio.cli.quantize import main

    base, adapters = tiny
    folder = tmp_path / "int4"
    assert main(["--method", "int4", "--group-size", "32", "--calibration-tokens", "64", base, str(folder)]) == 0
    modules = [f"{n}={p}" for n, p in adapters.items()]
    cores = {}
    for quantization in ("auto", "none"):
        runner = ModelRunner(RuntimeConfig(num_kv_blocks=64, block_size=4, quantization=quantization,
                                           dtype="float32", batch_invariant=batch_invariant), str(folder),
                             enable_lora=True, max_lora_rank=64, lora_modules=modules)
        cores[quantization] = EngineCore(runner, enable_prefix_caching=False)
    assert cores["auto"].runner.stats()["quantization"] == "awq"
    prompt = PROMPTS[12]
    dense_base = prompt_logprobs(cores["none"], prompt, None, "b")
    for name in ADAPTERS:
        served = prompt_logprobs(cores["auto"], prompt, name, f"q-{name}")
        dense = prompt_logprobs(cores["none"], prompt, name, f"d-{name}")
        err, without = (served - dense).abs(), (served - dense_base).abs()
        # bf16 activations round the adapters' large deltas too (rsLoRA's scale is 8 here): the
        # mean, and the worst position within reason
        assert err.mean() < 0.1 and err.mean() < without.mean() / 10 and err.max() < 1.0, (name, err, without)


@pytest.mark.slow
def test_smollm2_mixed_batch_against_peft(smollm_dir, tmp_path, batch_invariant):
    """SmolLM2-135M-Instruct unquantized in fp32, the three adapters and the base in one batch
    of 16 streams; a token may differ from the reference's argmax only at a near-tie."""
    from transformers import AutoModelForCausalLM

    adapters = {name: write_adapter(smollm_dir, tmp_path / name, *spec, seed=i, std=0.05)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    runner = ModelRunner(RuntimeConfig(num_kv_blocks=256, block_size=16, quantization="none", dtype="float32",
                                       batch_invariant=batch_invariant), smollm_dir, enable_lora=True, max_loras=4, max_lora_rank=64,
                         lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    prompts = [[(977 * i + 131 * j) % 40000 + 100 for j in range(6 + 3 * i)] for i in range(16)]
    choices = [CHOICES[i % 4] for i in range(16)]
    results = run(EngineCore(runner, max_num_seqs=16, max_num_batched_tokens=256), prompts, choices)
    for name in CHOICES:
        ref = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)
        if name is not None:
            ref = peft.PeftModel.from_pretrained(ref, adapters[name]).merge_and_unload()
        ref.eval()
        for prompt, choice, (tokens, lps, _) in zip(prompts, choices, results):
            if choice != name:
                continue
            with torch.inference_mode():
                logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            for i, token in enumerate(tokens):
                assert logits[i].max() - logits[i, token] < 1e-3, (name, i)  # its argmax, or a near-tie
                assert lps[i].top_logprobs == pytest.approx(logits[i].topk(5).values.tolist(), abs=2e-3)

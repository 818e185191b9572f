"""The served path end to end, and greedy tokens across the ways a step runs: a tiny random-weight
model with a word-level tokenizer, both written here (nothing to download), served by a real
``folio serve``, answers concurrent greedy completions with the tokens the in-process engine computes
on the CPU torch backend; and the in-process engine with CUDA graphs and without
(``enforce_eager``) computes those tokens too.

The ``gpu`` tests do this on the device (``--device cuda``, fp32: padded graph GEMMs in 16-bit types
may round differently); they are scripts/gpu_check.sh's first stage. The others are their CPU
stand-ins for ``gpu_check.sh --dry-run``: the server on the CPU, and the kernels (eager and through
the decode graphs' static buffers) run by the CUDA emulation.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from folio.testing.models import write_tiny_model
from folio.testing.server import start_server, stop_server

VOCAB = 256
# lengths 3 to 58: prefills of one to four 16-token blocks, decode batches shrinking as requests end
PROMPTS = [[(7 * i + 3 * j + 5) % VOCAB for j in range(3 + 11 * i)] for i in range(6)]
MAX_TOKENS = [12, 20, 6, 16, 9, 14]
EMULATED_TOKENS = [8, 4]  # the emulated kernels run the first prompts, shorter (the emulation is slow)
SERVE_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "16", "--max-num-seqs", "8",
               "--served-model-name", "tiny")


def write_served_model(folder) -> str:
    """Head size 64 (a built kernel instance), 4 query heads over one KV head; the tokenizer maps
    word ``wN`` to token N, so any token id list is a prompt and decodes to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    write_tiny_model(folder, vocab_size=VOCAB, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                     intermediate_size=128, bos_token_id=0, eos_token_id=1)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="w0", eos_token="w1",
                            unk_token="w2").save_pretrained(folder)
    return str(folder)


def sampling(n: int):
    from folio.shared.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def in_process_tokens(model: str, device: str, max_tokens: list[int] = MAX_TOKENS, enforce_eager: bool = False,
                      prepare_runner=None) -> tuple[list[list[int]], object]:
    """The in-process engine (the real scheduler) over the first prompts, one per ``max_tokens``; the
    runner, to look at."""
    from folio.core.engine import generate
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig

    config = RuntimeConfig(device=device, dtype="float32", num_kv_blocks=128, block_size=16, max_num_seqs=8,
                           attention_backend="torch" if device == "cpu" else "cuda", enforce_eager=enforce_eager)
    runner = ModelRunner(config, model)
    if prepare_runner is not None:
        prepare_runner(runner)
    return generate(runner, PROMPTS[:len(max_tokens)], [sampling(n) for n in max_tokens]), runner


def completion_tokens(base_url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One streamed greedy completion; its token ids (``return_token_ids``)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    request = urllib.request.Request(f"{base_url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    tokens.extend(choice.get("token_ids") or [])
    return tokens


def served_tokens(model: str, device: str, record_property) -> tuple[list[list[int]], dict]:
    """Every prompt sent at once to ``folio serve --device DEVICE``; the tokens and the executor's stats."""
    server = start_server(model, "--device", device, *SERVE_FLAGS, ready_timeout_s=120)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            tokens = list(pool.map(lambda a: completion_tokens(server.base_url, *a), zip(PROMPTS, MAX_TOKENS)))
        seconds = time.perf_counter() - start
        stats = server.admin("executor", "stats")
    finally:
        stop_server(server)
    record_property("served_seconds", round(seconds, 3))
    record_property("served_tokens_per_s", round(sum(map(len, tokens)) / seconds, 1))
    return tokens, stats


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_served_model(tmp_path_factory.mktemp("served-tiny"))


@pytest.fixture(scope="module")
def cpu_tokens(model) -> list[list[int]]:
    """The oracle: the CPU torch backend in process."""
    tokens, _ = in_process_tokens(model, "cpu")
    assert [len(t) for t in tokens] == MAX_TOKENS
    return tokens


@pytest.mark.gpu
def test_served_on_the_gpu_gives_the_cpu_tokens(model, cpu_tokens, record_property):
    pytest.importorskip("cupy")
    tokens, stats = served_tokens(model, "cuda", record_property)
    record_property("graph_replays", stats["num_graph_replays"])
    assert stats["attention_backend"] == "cuda"
    assert stats["num_graph_replays"] > 0, "the served decode steps never replayed a CUDA graph"
    assert tokens == cpu_tokens


@pytest.mark.gpu
def test_graphs_on_and_off_give_the_cpu_tokens(model, cpu_tokens, record_property):
    pytest.importorskip("cupy")
    graphed, runner = in_process_tokens(model, "cuda")
    assert runner.backend.name == "cuda"
    assert runner.graphs is not None and runner.graphs.num_replays > 0
    record_property("graph_replays", runner.graphs.num_replays)
    eager, eager_runner = in_process_tokens(model, "cuda", enforce_eager=True)
    assert eager_runner.graphs is None
    assert graphed == cpu_tokens
    assert eager == cpu_tokens


@pytest.mark.slow  # a served stack: 10-20 s
def test_served_on_the_cpu_gives_the_in_process_tokens(model, cpu_tokens, record_property):
    tokens, stats = served_tokens(model, "cpu", record_property)
    assert stats["attention_backend"] == "torch"
    assert tokens == cpu_tokens


@pytest.mark.slow  # the emulated kernels: about 10 s
def test_emulated_kernels_with_graphs_and_without_give_the_cpu_tokens(model, cpu_tokens, emu_launcher):
    from folio.core.executor.kernels.kernel_backend import KernelAttentionBackend
    from folio.core.executor.runtime.cuda_graphs import DecodeGraphs, graph_buckets

    def emulated(graphs: bool):
        def prepare_runner(runner):
            runner.backend = KernelAttentionBackend(emu_launcher, runner.dtype)
            if graphs:  # the graph path's static, padded buffers (a CPU captures nothing)
                runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.pool.kv_caches, 16, 4,
                                             graph_buckets(8), runner.device, capture=False)
        return prepare_runner

    eager, _ = in_process_tokens(model, "cpu", EMULATED_TOKENS, prepare_runner=emulated(False))
    graphed, runner = in_process_tokens(model, "cpu", EMULATED_TOKENS, prepare_runner=emulated(True))
    assert runner.graphs.num_replays > 0
    assert {name.split("<")[0] for name, _, _ in emu_launcher.launches} >= {"folio::paged_decode",
                                                                             "folio::paged_attention"}
    expected = [tokens[:n] for tokens, n in zip(cpu_tokens, EMULATED_TOKENS)]  # ignore_eos: a greedy prefix
    assert eager == expected
    assert graphed == expected

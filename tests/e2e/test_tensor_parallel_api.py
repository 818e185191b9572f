"""``folio serve -tp 2`` on the CPU: a tiny random model (SmolLM2's tokenizer and vocabulary)
split over two ranks serves completions, streamed chat, and the greedy tokens one rank computes;
``folio executor stats`` shows both ranks; a rank that dies takes the executor down and the
restarted executor serves again (new epoch)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import psutil
import pytest

from folio.testing.models import write_tiny_model
from folio.testing.server import start_server, stop_server
from tests.core.engine import LocalEngine, engine_request

pytestmark = pytest.mark.slow  # a served stack of ranks, restarted: 15 s

PROMPT = [504, 3458, 282, 4889, 314, 253, 1345, 30]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_with_tokenizer(smollm_tokenizer_dir, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tp-serve")
    write_tiny_model(path, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                     tie_word_embeddings=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{smollm_tokenizer_dir}/{name}", path / name)
    return str(path)


@pytest.fixture(scope="module")
def tp_server(tiny_with_tokenizer):
    srv = start_server(tiny_with_tokenizer, "-tp", "2", "--served-model-name", "m", "--num-kv-blocks", "128", "--max-num-seqs", "8")
    yield srv
    stop_server(srv)


def one_rank_tokens(model: str) -> list[int]:
    from folio.core.executor.runtime.runner import ModelRunner
    from folio.shared.config import RuntimeConfig

    runner = ModelRunner(RuntimeConfig(model=model, device="cpu", dtype="float32", quantization="none",
                                       num_kv_blocks=32), model)
    engine = LocalEngine(runner)
    engine.add(engine_request("r", PROMPT, MAX_TOKENS, eos_token_id=2))
    return engine.run()["r"].token_ids


def _child(service: str, parent: int) -> int:
    for proc in psutil.Process(parent).children(recursive=True):
        if "run" in proc.cmdline() and service in proc.cmdline():
            return proc.pid
    raise AssertionError(f"no {service} process under {parent}")


def test_serves_what_one_rank_computes(tp_server, tiny_with_tokenizer):
    import openai
    from tokenizers import Tokenizer

    client = openai.OpenAI(base_url=tp_server.base_url, api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(model="m", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    expected = one_rank_tokens(tiny_with_tokenizer)
    tokenizer = Tokenizer.from_file(f"{tiny_with_tokenizer}/tokenizer.json")
    assert completion.usage.completion_tokens == len(expected)
    assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, stream=True, temperature=0.7, seed=3)
    chunks = [c for c in stream]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")

    out = subprocess.run([sys.executable, "-m", "folio.cli.main", "executor", "stats", "--json",
                          "--run-dir", tp_server.endpoints.admin_executor.removeprefix("ipc://").rsplit("/", 1)[0]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["tensor_parallel_size"] == 2
    ranks = stats["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["device"] == "cpu" and r["num_steps"] > 0 and r["weight_bytes"] > 0 for r in ranks)


def test_a_dead_rank_restarts_the_executor(tp_server):
    import openai

    epoch = tp_server.admin("executor", "stats")["epoch"]
    executor = psutil.Process(_child("executor", tp_server.proc.pid))
    rank1 = [p for p in executor.children() if any("spawn_main" in part for part in p.cmdline())]
    assert rank1, "the executor has no worker process"
    rank1[0].kill()
    tp_server.wait_for(lambda: not executor.is_running() or executor.status() == psutil.STATUS_ZOMBIE,
                       timeout_s=60, what="the executor to exit")

    def new_epoch():
        from folio.shared.transport import ask_service

        reply = ask_service(tp_server.endpoints, "executor", "stats", {}, 2.0)
        return reply is not None and reply.ok and reply.data["epoch"] != epoch

    tp_server.wait_for(new_epoch, timeout_s=180, what="a restarted executor")
    client = openai.OpenAI(base_url=tp_server.base_url, api_key="unused", max_retries=0, timeout=120)
    tp_server.wait_for(lambda: tp_server.admin("scheduler", "stats").get("pool_ready", True), timeout_s=60,
                       what="the new pool")

    def served():  # the gateway says 503 "retry later" until its probes have seen the new executor
        try:
            return client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
        except openai.InternalServerError as exc:
            assert exc.status_code == 503, exc
            return None

    completion = tp_server.wait_for(served, timeout_s=60, what="the gateway to serve again")
    assert completion.usage.completion_tokens == 4

"""LoRA adapters through a real ``folio serve`` (five processes, HTTP) on a tiny Llama in fp32, with
two adapters written by ``peft`` (non-zero A and B) given as ``--lora-modules``. A request picks an
adapter by its ``model``: its greedy tokens must be those of ``peft``'s merged model in
transformers (and differ from the base model's); ``/v1/models`` lists the adapters with their
``parent``; an unknown model is a 404 ``model_not_found``. At run time (``--allow-runtime-lora``,
behind the API key): a third adapter is loaded and used, then unloaded (its name then a 404); a
bad folder or a rank above ``--max-lora-rank`` is a 400 saying why and changes nothing; unloading
an adapter with a request in flight is a 409; streams on the other adapters finish with the same
tokens while adapters are loaded and unloaded. ``/metrics`` carries the adapters' gauges."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from folio.testing.peft_adapters import write_peft_adapter
from folio.testing.models import write_tiny_chat_model
from folio.testing.server import start_server, stop_server

import peft  # noqa: E402  (a test extra: a missing peft fails, never skips)

KEY = "lora-key"
PROMPTS = [[1, 504, 1923, 7803, 28, 253, 2756], [1, 9690, 314, 260, 4536, 282, 3489, 30]]
MAX_TOKENS = 10
# name: rank, targets, seed
ADAPTERS = {"sql": (8, ["q_proj", "v_proj"], 1), "chat": (16, ["o_proj", "gate_proj", "down_proj"], 2)}


def write_adapter(base: str, out_dir, rank: int, targets: list[str], seed: int) -> str:
    return write_peft_adapter(base, out_dir, rank, targets, seed=seed)


def peft_greedy(base: str, adapter: str | None) -> list[list[int]]:
    """Each prompt's greedy tokens from transformers, the adapter merged by ``peft``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    model.generation_config.eos_token_id = None  # as the requests' ignore_eos
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids),
                                 pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, smollm_tokenizer_dir):
    root = tmp_path_factory.mktemp("lora-served")
    base = write_tiny_chat_model(root / "tiny", smollm_tokenizer_dir)
    adapters = {name: write_adapter(base, root / name, *spec) for name, spec in ADAPTERS.items()}
    adapters["late"] = write_adapter(base, root / "late", 4, ["k_proj", "up_proj"], 3)
    adapters["wide"] = write_adapter(base, root / "wide", 32, ["q_proj"], 4)  # above --max-lora-rank 16
    expected = {name: peft_greedy(base, adapters.get(name)) for name in (None, "sql", "chat", "late")}
    server = start_server(base, "--dtype", "float32", "--num-kv-blocks", "96", "--max-num-seqs", "8",
                          "--api-key", KEY, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}",
                          f"chat={adapters['chat']}", "--max-loras", "2", "--max-lora-rank", "16",
                          "--allow-runtime-lora")
    yield server, base, adapters, expected
    stop_server(server)


def call(server, path: str, body: dict | None = None, key: str | None = KEY):
    """(status, the reply: JSON, or text)."""
    url = server.base_url.removesuffix("/v1") + path
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=120) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def completion(server, model: str | None, prompt: list[int], stream: bool = False, max_tokens: int = MAX_TOKENS):
    """The greedy completion's text (a stream's pieces joined)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    if not stream:
        status, reply = call(server, "/v1/completions", body)
        assert status == 200, reply
        assert reply["model"] == (model or reply["model"])
        return reply["choices"][0]["text"]
    req = urllib.request.Request(server.base_url + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def expected_texts(base: str, expected: dict, name: str | None) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    return [tok.decode(ids, skip_special_tokens=True) for ids in expected[name]]


def test_requests_pick_their_adapter_by_model(lora_server):
    server, base, adapters, expected = lora_server
    base_name = base.rstrip("/").rsplit("/", 1)[-1]
    results: dict = {}

    def run(model, i):
        results[(model, i)] = completion(server, model, PROMPTS[i])

    # every adapter and the base model at once: one mixed batch
    threads = [threading.Thread(target=run, args=(m, i)) for m in (None, "sql", "chat", base_name)
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for model in (None, "sql", "chat"):
        want = expected_texts(base, expected, model)
        assert [results[(model, i)] for i in range(len(PROMPTS))] == want, model
    assert [results[(base_name, i)] for i in range(len(PROMPTS))] == expected_texts(base, expected, None)
    assert expected["sql"] != expected[None] and expected["chat"] != expected[None]
    assert expected["sql"] != expected["chat"]


def test_models_lists_the_adapters_with_their_parent(lora_server):
    server, base, adapters, _ = lora_server
    status, body = call(server, "/v1/models")
    assert status == 200
    cards = {m["id"]: m for m in body["data"]}
    base_name = body["data"][0]["id"]
    assert base_name == base.rstrip("/").rsplit("/", 1)[-1] and cards[base_name]["parent"] is None
    assert {n: (cards[n]["parent"], cards[n]["root"]) for n in ("sql", "chat")} == \
        {"sql": (base_name, adapters["sql"]), "chat": (base_name, adapters["chat"])}


def test_an_unknown_model_is_a_404(lora_server):
    server = lora_server[0]
    status, body = call(server, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    status, body = call(server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user",
                                                                                       "content": "hi"}]})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_runtime_load_use_and_unload(lora_server, tmp_path):
    server, base, adapters, expected = lora_server
    load = {"lora_name": "late", "lora_path": adapters["late"]}
    status, body = call(server, "/v1/load_lora_adapter", load, key=None)
    assert status == 401  # behind the API key
    # refusals say why and change nothing
    for path, why in ((str(tmp_path / "missing"), "not a folder"), (adapters["wide"], "above max_lora_rank 16")):
        status, body = call(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert status == 400 and why in body["error"]["message"], body
    status, body = call(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["late"]})
    assert status == 400 and "already been loaded" in body["error"]["message"]
    assert [m["id"] for m in call(server, "/v1/models")[1]["data"]][1:] == ["sql", "chat"]
    status, body = call(server, "/v1/completions", {"model": "bad", "prompt": "hi", "max_tokens": 2})
    assert status == 404

    status, body = call(server, "/v1/load_lora_adapter", load)
    assert status == 200 and body == "Success: LoRA adapter 'late' added successfully."
    assert [completion(server, "late", p) for p in PROMPTS] == expected_texts(base, expected, "late")
    assert [m["id"] for m in call(server, "/v1/models")[1]["data"]][1:] == ["sql", "chat", "late"]

    status, body = call(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200 and body == "Success: LoRA adapter 'late' removed successfully."
    status, body = call(server, "/v1/completions", {"model": "late", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = call(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 404
    # still serving, the adapters as before
    assert completion(server, "sql", PROMPTS[0]) == expected_texts(base, expected, "sql")[0]


def test_streams_finish_unchanged_while_adapters_come_and_go(lora_server):
    server, base, adapters, expected = lora_server
    longer = 24
    reference = {m: completion(server, m, PROMPTS[1], max_tokens=longer) for m in ("sql", "chat", None)}
    streamed: dict = {}

    def run(model):
        streamed[model] = completion(server, model, PROMPTS[1], stream=True, max_tokens=longer)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("sql", "chat", None)]
    for t in threads:
        t.start()
    statuses = []
    for _ in range(2):
        statuses.append(call(server, "/v1/load_lora_adapter", {"lora_name": "late",
                                                               "lora_path": adapters["late"]})[0])
        statuses.append(call(server, "/v1/unload_lora_adapter", {"lora_name": "late"})[0])
    for t in threads:
        t.join()
    assert statuses == [200, 200, 200, 200]
    assert streamed == reference
    assert len(set(reference.values())) == 3  # each adapter and the base model wrote its own text


def test_unloading_an_adapter_with_a_request_in_flight_is_a_409(lora_server):
    server, base, adapters, expected = lora_server
    body = {"model": "chat", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(server.base_url + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.readline().startswith(b"data: ")  # the stream is open
        status, reply = call(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert status == 409 and "in flight" in reply["error"]["message"], reply
    assert completion(server, "chat", PROMPTS[0]) == expected_texts(base, expected, "chat")[0]
    # the client hung up: once its request is aborted the adapter may go (then it comes back)
    server.wait_for(lambda: call(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})[0] == 200,
                    what="the unload once the stream was aborted")
    assert call(server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]})[0] == 200
    assert completion(server, "chat", PROMPTS[0]) == expected_texts(base, expected, "chat")[0]


def test_metrics_show_the_adapters(lora_server):
    server = lora_server[0]
    from folio.services.router.replicas import read_active_adapters

    completion(server, "sql", PROMPTS[0])
    with urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert 'folio:lora_requests_info{max_lora="2"' in text
    assert read_active_adapters(text) == frozenset()  # nothing runs now
    loads = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("folio:lora_loads_total")]
    assert loads and loads[0] >= 2  # sql and chat at least, into their slots

"""Disaggregated serving for real: ``folio serve --kv-role prefill`` and two ``--kv-role decode``
instances (SmolLM2-135M int4, CPU, tcp between them) behind ``folio run router --prefill --decode``.
Every answer through prefill -> decode equals a single instance's (the decode instance asked
directly, without a handle): greedy and seeded, streamed and not, n > 1, 32 at once; a layout
mismatch is refused; a transfer staged for one decode instance's key is refused to another key; a
decode instance killed mid-stream and then the prefill instance killed lose no request. The first
decode instance has a key of its own (``folio keys init --peer``, ``,key=`` in the router's
``--decode``), the second the stack's client key. The stack starts once; the tests run in order
(the kills come last)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from folio.core.kv.tensors.pool import KVPool, PoolShape
from folio.core.kv.tensors.transfer import KVLayout, LayoutMismatch, TransferError
from folio.services.executor.kv_sockets import KVReceiver
from folio.shared.keys import init_peer, load_keys, sign
from folio.shared.messages import TransferHandle
from folio.shared.curve import stack_keys
from folio.testing.routerstack import ReplicaProcess, post, start_router

pytestmark = pytest.mark.slow
# batch-invariant: answers computed beside others, on another instance, must equal a single instance's bit for bit
FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-num-batched-tokens", "512", "--batch-invariant")
PROMPTS = ["The history of the printing press in Europe begins",
           "Write a short list of three fruits:",
           " ".join(f"Step {i}: mix the flour and water, then wait." for i in range(12))]  # > one block


def stream(url: str, body: dict, on_first=None, timeout_s: float = 120.0) -> tuple[dict[int, str], dict[int, str]]:
    """(text by choice index, finish reason by index) of one streamed request."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        assert resp.status == 200
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                texts[c["index"]] = texts.get(c["index"], "") + (text or "")
                if c.get("finish_reason"):
                    finish[c["index"]] = c["finish_reason"]
                if on_first is not None:
                    on_first(), (on_first := None)
    return texts, finish


def completion(url: str, prompt: str, **kw) -> tuple[int, dict]:
    status, body, _ = post(url + "/v1/completions", {"prompt": prompt, **kw})
    return status, body


def exported(prefill, kv_transfer: dict):
    """A prompt's KV staged for export on the prefill instance: (its kv_transfer reply, the handle
    a receiver pulls with, the pool's dtype)."""
    status, body = completion(prefill.url, PROMPTS[2], max_tokens=1, temperature=0, kv_transfer=kv_transfer)
    assert status == 200, body
    kt = body["kv_transfer"]
    handle = TransferHandle(transfer_id=kt["transfer_id"], endpoint=f"tcp://127.0.0.1:{kt['port']}",
                            num_blocks=kt["num_blocks"], num_tokens=kt["num_prompt_tokens"])
    return kt, handle, getattr(torch, prefill.admin("executor", "stats")["kv_cache_dtype"])


def texts_of(body: dict) -> dict[int, str]:
    return {c["index"]: c["text"] for c in body["choices"]}


def stack_of(kv_flags: tuple[str, ...], num_decode: int):
    p = ReplicaProcess("SmolLM2-135M-Instruct", FLAGS + ("--kv-role", "prefill") + kv_flags).start()
    init_peer(stack_keys().folder, "decode-1")
    ds = [ReplicaProcess("SmolLM2-135M-Instruct", FLAGS + ("--kv-role", "decode") + kv_flags,
                  peer_key="decode-1" if i == 0 else None).start() for i in range(num_decode)]
    router = None
    try:
        for r in (p, *ds):
            r.wait_ready(300)
        router = start_router("SmolLM2-135M-Instruct", [], "--prefill", p.spec,
                              *[x for d in ds for x in ("--decode", d.spec)], num_up=1 + num_decode)
        return p, ds, router
    except BaseException:
        for r in (p, *ds):
            r.cleanup()
        raise


@pytest.fixture(scope="module")
def stack():
    p, ds, router = stack_of((), 2)
    yield p, ds, router
    router.stop()
    for r in (p, *ds):
        r.cleanup()


SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 11}]


def test_outputs_through_prefill_and_decode_equal_a_single_instance(stack):
    p, (d1, d2), router = stack
    for prompt in PROMPTS:
        for sampling in SAMPLINGS:
            status, solo = completion(d2.url, prompt, max_tokens=6, **sampling)
            assert status == 200, solo
            status, got = completion(router.url, prompt, max_tokens=6, **sampling)
            assert status == 200, got
            assert texts_of(got) == texts_of(solo), (prompt, sampling)
            assert got["usage"]["completion_tokens"] == solo["usage"]["completion_tokens"]
            assert "kv_transfer" not in got
            streamed, finish = stream(router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 6, **sampling})
            assert streamed == texts_of(solo) and finish[0] == solo["choices"][0]["finish_reason"]
    # n > 1, seeded: choice i seeded seed + i, as one instance does it
    status, solo = completion(d2.url, PROMPTS[0], max_tokens=5, n=3, temperature=1.0, seed=5)
    status, got = completion(router.url, PROMPTS[0], max_tokens=5, n=3, temperature=1.0, seed=5)
    assert status == 200 and texts_of(got) == texts_of(solo)
    streamed, _ = stream(router.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 5, "n": 3,
                                                          "temperature": 1.0, "seed": 5})
    assert streamed == texts_of(solo)
    # chat, streamed: the first token's chunk comes from the prefill side
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5, "temperature": 0}
    status, solo_chat, _ = post(d2.url + "/v1/chat/completions", chat)
    streamed, _ = stream(router.url + "/v1/chat/completions", chat)
    assert streamed[0] == solo_chat["choices"][0]["message"]["content"]
    # the KV moved: the prefill side exported and the decode sides pulled, nothing recomputed
    sent = p.admin("executor", "stats")
    pulls = [d.admin("executor", "stats") for d in (d1, d2)]
    assert sent["kv_transfers"]["confirmed"] >= 10 and sum(s["kv_pulls"]["pulled"] for s in pulls) >= 10
    assert all(s["kv_recomputed"] == 0 for s in pulls)
    assert sum(d.admin("scheduler", "stats").get("num_kv_imported_tokens", 0) for d in (d1, d2)) > 0


def test_32_concurrent_requests(stack):
    p, (d1, d2), router = stack
    # greedy and seeded alternate; every third job is streamed (both kinds)
    jobs = [(PROMPTS[i % 3] + f" (variant {i})", SAMPLINGS[i % 2], i % 3 == 0) for i in range(32)]
    solo = [texts_of(completion(d2.url, prompt, max_tokens=4, **s)[1]) for prompt, s, _ in jobs]

    def one(job):
        prompt, s, streamed = job
        if streamed:
            return stream(router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, **s})[0]
        status, body = completion(router.url, prompt, max_tokens=4, **s)
        assert status == 200, body
        return texts_of(body)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, jobs))
    assert got == solo


def test_the_extension_is_validated(stack):
    p, (d1, d2), router = stack
    status, body = completion(d1.url, "hi", max_tokens=2, kv_transfer={"export": True})
    assert status == 400 and "prefill" in body["error"]["message"]
    status, body = completion(d1.url, "hi", max_tokens=2, kv_transfer={"handle": {"transfer_id": "x"},
                                                                        "forced_token_ids": [1]})
    assert status == 400 and "signed by the router" in body["error"]["message"]
    # a plain client naming someone's transfer, well-formed but unsigned, or signed then altered
    handle = {"transfer_id": "a" * 32, "endpoint": "tcp://127.0.0.1:1", "num_blocks": 1, "num_tokens": 3}
    status, body = completion(d1.url, "hi", max_tokens=2, kv_transfer={"handle": handle, "forced_token_ids": [1]})
    assert status == 400 and "signed by the router" in body["error"]["message"]
    signed = {**sign(stack_keys(), handle, 60), "endpoint": "tcp://evil:1"}
    status, body = completion(d1.url, "hi", max_tokens=2, kv_transfer={"handle": signed, "forced_token_ids": [1]})
    assert status == 400 and "signature does not match" in body["error"]["message"]
    signed = sign(stack_keys(), {"transfer_id": "x"}, 60)  # signed, but no handle
    status, body = completion(d1.url, "hi", max_tokens=2, kv_transfer={"handle": signed, "forced_token_ids": [1]})
    assert status == 400 and "invalid kv transfer handle" in body["error"]["message"]
    status, body = completion(p.url, "hi", max_tokens=1, n=2, kv_transfer={"export": True})
    assert status == 400 and body["error"]["param"] == "kv_transfer"


def test_a_transfer_staged_for_one_key_is_refused_to_another(stack):
    p, (d1, _), _ = stack
    folder = stack_keys().folder
    named = load_keys(folder, peer="decode-1")
    kt, handle, dtype = exported(p, {"export": True, "export_to": named.client_public.decode()})
    pool = KVPool(PoolShape(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype),
                  kt["num_blocks"], torch.device("cpu"))
    refused = p.admin("executor", "stats")["kv_transfers"]["refused"]
    with pytest.raises(TransferError, match="not outstanding"):  # the stack's client key: a valid key, not the named one
        KVReceiver(pool, KVLayout.of(pool), keys=load_keys(folder, peer="")).pull(handle, list(range(kt["num_blocks"])))
    assert p.admin("executor", "stats")["kv_transfers"]["refused"] == refused + 1
    assert pool.kv_caches[0][0].abs().sum() == 0
    assert KVReceiver(pool, KVLayout.of(pool), keys=named).pull(handle, list(range(kt["num_blocks"]))) > 0
    assert pool.kv_caches[0][0].abs().sum() > 0
    # through the router, the first decode instance pulls with its own key, nothing is recomputed
    assert d1.admin("executor", "stats")["kv_pulls"]["pulled"] > 0 and d1.admin("executor", "stats")["kv_recomputed"] == 0


def test_a_layout_mismatch_is_refused(stack):
    p, _, _ = stack
    kt, handle, dtype = exported(p, {"export": True})
    # SmolLM2: 30 layers, 3 KV heads of 64, in the executor's pool dtype; this pool has 2 heads
    wrong = KVPool(PoolShape(num_layers=30, block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype),
                   kt["num_blocks"], torch.device("cpu"))
    with pytest.raises(LayoutMismatch, match="num_kv_heads: 3 vs 2"):
        KVReceiver(wrong, KVLayout.of(wrong)).pull(handle, list(range(kt["num_blocks"])))
    right = KVPool(PoolShape(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype),
                   kt["num_blocks"], torch.device("cpu"))
    assert KVReceiver(right, KVLayout.of(right)).pull(handle, list(range(kt["num_blocks"]))) > 0
    assert right.kv_caches[0][0][0].abs().sum() > 0  # the prompt's KV landed


def test_a_client_that_leaves_mid_stream_takes_no_decode_instance_down(stack):
    p, ds, router = stack
    before = router.admin("stats")
    aborted = sum(d.admin("scheduler", "stats")["num_requests_aborted"] for d in ds)
    host, port = urllib.parse.urlsplit(router.url).netloc.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPTS[0], "max_tokens": 200, "stream": True,
                                                        "ignore_eos": True, "temperature": 0}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 60
    while router.admin("stats")["num_client_disconnects"] == before["num_client_disconnects"]:
        assert time.monotonic() < deadline, "the router never saw the client go"
        time.sleep(0.1)
    while sum(d.admin("scheduler", "stats")["num_requests_aborted"] for d in ds) == aborted:
        assert time.monotonic() < deadline, "the decode instance did not abort the request"
        time.sleep(0.1)
    after = router.admin("stats")
    assert (after["num_decode_resumes"], after["num_decode_retries"]) == \
        (before["num_decode_resumes"], before["num_decode_retries"])
    assert all(r["up"] for r in router.replicas().values())


def test_a_decode_instance_killed_mid_stream_loses_no_stream(stack):
    p, (d1, d2), router = stack
    jobs = [(PROMPTS[i % 3] + f" (stream {i})", SAMPLINGS[0]) for i in range(6)]
    solo = [texts_of(completion(d2.url, prompt, max_tokens=24, **s)[1]) for prompt, s in jobs]
    started = threading.Event()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, router.url + "/v1/completions", {"prompt": prompt, "max_tokens": 24, **s},
                               started.set) for prompt, s in jobs]
        assert started.wait(60)
        time.sleep(0.3)
        d1.kill()
        got = [f.result()[0] for f in futures]
    assert got == solo
    stats = router.admin("stats")
    assert stats["num_disagg_requests"] >= 6


def test_a_killed_prefill_instance_loses_no_request(stack):
    """With the only prefill instance gone, requests run whole on the decode instance (colocated)."""
    p, (d1, d2), router = stack
    jobs = [(PROMPTS[i % 3] + f" (late {i})", SAMPLINGS[0]) for i in range(6)]
    solo = [texts_of(completion(d2.url, prompt, max_tokens=4, **s)[1]) for prompt, s in jobs]
    with ThreadPoolExecutor(6) as pool:
        # half in flight when the prefill instance dies (they may well be done: 4 tokens are quick), half
        # sent after it died, which must run colocated
        futures = [pool.submit(completion, router.url, prompt, max_tokens=4, **s) for prompt, s in jobs[:3]]
        time.sleep(0.2)
        p.kill()
        futures += [pool.submit(completion, router.url, prompt, max_tokens=4, **s) for prompt, s in jobs[3:]]
        got = [f.result() for f in futures]
    assert all(status == 200 for status, _ in got), got
    assert [texts_of(body) for _, body in got] == solo
    assert router.admin("stats")["num_colocated_fallbacks"] >= 1


@pytest.fixture(scope="module")
def fp8_stack(stack):
    # after the bf16 stack's tests (it is torn down with the module; this one runs beside its survivors)
    p, ds, router = stack_of(("--kv-cache-dtype", "fp8"), 1)
    yield p, ds[0], router
    router.stop()
    for r in (p, *ds):
        r.cleanup()


def test_the_fp8_kv_cache_moves_with_its_scales(fp8_stack):
    p, d, router = fp8_stack
    for prompt in PROMPTS:
        for sampling in SAMPLINGS:
            status, solo = completion(d.url, prompt, max_tokens=5, **sampling)
            status, got = completion(router.url, prompt, max_tokens=5, **sampling)
            assert status == 200 and texts_of(got) == texts_of(solo), (prompt, sampling)
    streamed, _ = stream(router.url + "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0})
    assert streamed == texts_of(completion(d.url, PROMPTS[2], max_tokens=5, temperature=0)[1])
    stats = d.admin("executor", "stats")
    assert stats["kv_pulls"]["pulled"] >= 6 and stats["kv_recomputed"] == 0

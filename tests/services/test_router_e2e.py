"""The router in front of two real ``folio serve`` replicas (tiny random model with SmolLM2's
tokenizer and chat template, small KV pools, CPU): affinity of shared prefixes and conversations,
balance of uniform traffic, failover when a replica is killed under load, and a restarted
replica's lost affinity. The stacks start once for the module; the tests run in order."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from folio.testing.models import write_tiny_chat_model
from folio.testing.routerstack import ReplicaProcess, http_json, post, start_router

pytestmark = pytest.mark.slow  # two replicas and a router per test: 23 s in all

FLAGS = ("--served-model-name", "m", "--dtype", "float32", "--num-kv-blocks", "128", "--max-num-batched-tokens", "1024", "--max-num-seqs", "4",
         "--task", "generate,embed")
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and only about topic number {i}." for i in range(30))
SYSTEM2 = " ".join(f"Policy {i}: a tenant's second assistant speaks of subject {i} in French." for i in range(30))


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm_tokenizer_dir) -> str:
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-router"), smollm_tokenizer_dir, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def stack(model):
    a, b = ReplicaProcess(model, FLAGS).start(), ReplicaProcess(model, FLAGS).start()
    router = None
    try:
        a.wait_ready(), b.wait_ready()
        router = start_router(model, [a, b])
        yield a, b, router
    finally:
        if router is not None:
            router.stop()
        for r in (a, b):  # both stop at once
            if r.proc.poll() is None:
                r.proc.terminate()
        a.cleanup(), b.cleanup()


def chat(url: str, system: str, question: str, max_tokens: int = 4, **extra) -> tuple[int, dict, str]:
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], **extra}
    return post(url + "/v1/chat/completions", body)


def prefix_hits(replica: ReplicaProcess) -> int:
    return replica.admin("kvmanager", "stats")["num_prefix_cache_hits"]


def wait_until(predicate, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_shared_system_prompt_and_a_conversation_stay_where_their_prefix_is(stack):
    a, b, router = stack
    status, first, holder = chat(router.url, SYSTEM, "What is topic 3?")
    assert status == 200, first
    other = b if holder == a.url else a
    # its KV events reach the router: the prefix is known to be there
    wait_until(lambda: router.replicas()[holder]["indexed_blocks"] >= 20, "the holder's blocks in the index")
    holder_replica = a if holder == a.url else b
    hits_before = {r.url: prefix_hits(r) for r in (a, b)}
    hits_seen = router.admin("stats")["num_cache_aware_hits"]
    landed = [chat(router.url, SYSTEM, f"And what about topic {i}?")[2] for i in range(4)]
    turn2 = post(router.url + "/v1/chat/completions", {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is topic 3?"},
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Say more."}]})
    landed.append(turn2[2])
    assert landed == [holder] * 5
    assert router.admin("stats")["num_cache_aware_hits"] - hits_seen == 5
    # the replicas' own counters say why: the holder computed the system prompt once
    num_system_tokens = 300  # at least: the prompt is ~450 tokens
    assert prefix_hits(holder_replica) - hits_before[holder] >= 5 * num_system_tokens
    assert prefix_hits(other) == hits_before[other.url]
    # another tenant's salt shares nothing with it
    salted = chat(router.url, SYSTEM, "What is topic 3?", cache_salt="tenant-2")
    assert salted[0] == 200 and router.admin("stats")["num_cache_aware_hits"] - hits_seen == 5


def test_uniform_traffic_without_shared_prefixes_is_balanced(stack):
    a, b, router = stack
    before = {r.url: r.admin("gateway", "stats")["num_requests"] for r in (a, b)}
    words = ["apple", "river", "copper", "violin", "glacier", "lantern", "meadow", "orbit", "pepper", "quartz",
             "saddle", "thistle", "umbra", "velvet", "walnut", "yonder", "zephyr", "basalt", "cobalt", "dune"]
    prompts = [f"{w} " * 20 + f"number {i}" for i, w in enumerate(words)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: post(router.url + "/v1/completions",
                                               {"model": "m", "prompt": p, "max_tokens": 8, "temperature": 0}),
                                prompts))
    assert all(status == 200 for status, _, _ in results)
    counts = [a.admin("gateway", "stats")["num_requests"] - before[a.url],
              b.admin("gateway", "stats")["num_requests"] - before[b.url]]
    assert sum(counts) == len(prompts)
    # least cost by load, where a replica's polled load lags by up to a poll interval: each gets a
    # fair share, not an exact half (a clean run split 13/7 once)
    assert min(counts) >= 0.3 * len(prompts), counts
    # the admin CLI and /metrics tell the same
    cli = subprocess.run([sys.executable, "-m", "folio.cli.main", "router", "replicas", "--json", "--run-dir",
                          router.run_dir], capture_output=True, text=True, timeout=60)
    rows = {row["replica"]: row for row in json.loads(cli.stdout)["replicas"]}
    assert cli.returncode == 0 and set(rows) == {a.url, b.url} and all(row["up"] for row in rows.values())
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'folio_router:requests_routed_total{reason="cache"' in metrics
    assert "folio_router:cache_aware_hits_total 5.0" in metrics


def test_models_pass_through_and_a_bad_body_gets_an_openai_error(stack):
    a, b, router = stack
    with urllib.request.urlopen(router.url + "/v1/models", timeout=10) as resp:
        assert [m["id"] for m in json.loads(resp.read())["data"]] == ["m"]
    req = urllib.request.Request(router.url + "/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "not valid JSON" in json.loads(err.value.read())["error"]["message"]
    # the replica's own validation comes back through the router unchanged
    status, body, _ = post(router.url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens"


def stream_chat(url: str, question: str, max_tokens: int) -> tuple[int, bool, str]:
    """(status, whether [DONE] arrived, replica) of a streamed request read to its end."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": question}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = b""
            try:
                for line in resp:
                    text += line
            except (OSError, ValueError):
                pass  # cut mid-stream
            return resp.status, b"data: [DONE]" in text, resp.headers.get("X-Folio-Replica", "")
    except urllib.error.HTTPError as err:
        return err.code, False, ""


def test_a_prefix_cached_on_a_replica_draws_its_requests(stack):
    a, b, router = stack
    # b caches a second system prompt (asked directly): the router learns it from b's events alone
    assert chat(b.url, SYSTEM2, "Bonjour?")[0] == 200
    wait_until(lambda: router.replicas()[b.url]["indexed_blocks"] >= 25, "b's blocks in the index")
    assert [chat(router.url, SYSTEM2, f"Question {i}?")[2] for i in range(2)] == [b.url, b.url]


def test_a_client_that_leaves_mid_stream_takes_no_replica_down(stack):
    a, b, router = stack
    before = router.admin("stats")
    body = {"model": "m", "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count slowly."}]}
    host, port = urllib.parse.urlsplit(router.url).netloc.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    served_by = {r.url: r for r in (a, b)}[resp.headers["X-Folio-Replica"]]
    aborted = served_by.admin("scheduler", "stats")["num_requests_aborted"]
    assert resp.readline().startswith(b"data: ")  # the stream is under way
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away
    conn.close()
    wait_until(lambda: router.admin("stats")["num_client_disconnects"] > before["num_client_disconnects"],
               "the router to see the client go")
    # the replica aborts the request: its engine slot is not held for a client that left
    wait_until(lambda: served_by.admin("scheduler", "stats")["num_requests_aborted"] > aborted, "the abort")
    after = router.admin("stats")
    assert after["num_broken_streams"] == before["num_broken_streams"]
    assert after["num_resumed_streams"] == before["num_resumed_streams"]
    assert all(r["up"] for r in router.replicas().values())


def test_a_replica_killed_under_load_fails_over_without_a_hang(stack):
    a, b, router = stack
    retries_before = router.admin("stats")["num_retries"]
    with ThreadPoolExecutor(12) as pool:
        plain = [pool.submit(post, router.url + "/v1/completions", {
            "model": "m", "prompt": f"{w} " * 8, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            for w in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")]
        streams = [pool.submit(stream_chat, router.url, f"Stream {i}", 24) for i in range(4)]
        wait_until(lambda: b.admin("scheduler", "stats", must=False).get("num_waiting", 0) >= 1,
                   "requests queued on b", timeout_s=30)
        b.kill()
        results = [f.result(timeout=90) for f in plain]  # a hang fails here
        stream_results = [f.result(timeout=90) for f in streams]
    # requests that had not begun answering were retried on a and complete
    assert [status for status, _, _ in results] == [200] * len(results)
    assert all(len(body["choices"][0]["text"]) > 0 for _, body, _ in results)
    assert all(replica == a.url for _, _, replica in results)
    assert router.admin("stats")["num_retries"] > retries_before
    # streams already under way on b end (cut), the others complete
    assert all(status == 200 for status, _, _ in stream_results)
    assert all(done for _, done, replica in stream_results if replica == a.url)
    assert router.replicas()[b.url]["up"] is False
    # new work goes to the live replica
    assert [chat(router.url, SYSTEM2, f"After {i}?")[:3:2] for i in range(3)] == [(200, a.url)] * 3
    health = http_json(router.url + "/health")
    assert health["num_replicas_up"] == 1


def test_a_restarted_replica_has_no_affinity_until_it_caches_again(stack):
    a, b, router = stack
    b.start().wait_ready()  # same ports, an empty cache
    wait_until(lambda: router.replicas()[b.url]["up"] and router.replicas()[b.url]["in_sync"], "b back in the router")
    assert router.replicas()[b.url]["indexed_blocks"] == 0
    hits = router.admin("stats")["num_cache_aware_hits"]

    def clear_both():
        for r in (a, b):
            r.admin("kvmanager", "clear")
        wait_until(lambda: all(row["indexed_blocks"] == 0 for row in router.replicas().values()), "cleared index")

    clear_both()  # a's copy of SYSTEM2 (from the failover) goes too: nobody holds it now
    status, _, _ = chat(router.url, SYSTEM2, "Question again?")
    assert status == 200 and router.admin("stats")["num_cache_aware_hits"] == hits  # routed by load alone
    clear_both()
    # once b caches it again, it draws the prefix's requests again
    assert chat(b.url, SYSTEM2, "Encore?")[0] == 200
    wait_until(lambda: router.replicas()[b.url]["indexed_blocks"] >= 25, "b's new blocks in the index")
    assert chat(router.url, SYSTEM2, "One more?")[2] == b.url
    assert router.admin("stats")["num_cache_aware_hits"] == hits + 1


def test_responses_and_messages_pass_through_and_a_chain_finds_its_replica(stack):
    """The Responses and Messages APIs go through the router; a response stored by one replica is
    found by a chained request and by a read, whichever replica the router tries first."""
    *_, router = stack
    ids, replicas = [], set()
    for i in range(12):  # uniform traffic is balanced: both replicas come to store responses
        status, body, replica = post(router.url + "/v1/responses", {
            "model": "m", "input": f"Question {i}: say something.", "max_output_tokens": 3, "temperature": 0})
        assert status == 200, body
        ids.append(body["id"])
        replicas.add(replica)
        if len(replicas) == 2 and i >= 3:
            break
    assert len(replicas) == 2, replicas
    for response_id in ids:
        status, body, _ = post(router.url + "/v1/responses", {
            "model": "m", "input": "And then?", "previous_response_id": response_id, "max_output_tokens": 2})
        assert status == 200 and isinstance(body, dict) and body["previous_response_id"] == response_id, (status, body)
        with urllib.request.urlopen(f"{router.url}/v1/responses/{response_id}", timeout=30) as r:
            assert json.loads(r.read())["id"] == response_id
    status, body, _ = post(router.url + "/v1/responses", {
        "model": "m", "input": "x", "previous_response_id": "resp_unknown", "max_output_tokens": 2})
    assert status == 404, body
    status, body, _ = post(router.url + "/v1/messages", {
        "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and body["type"] == "message", body


def test_embeddings_rerank_and_score_pass_through(stack):
    """The pooling routes go through the router to a replica serving --task generate,embed: the
    same input gives the same vector whichever replica answers, and a bad body is the replica's 400."""
    *_, router = stack
    vectors, replicas = [], set()
    # routed by load (no prompt to match): a replica's polled load lags by up to a poll interval, so
    # one can look busy for a while after the last test; uniform traffic reaches both within seconds
    deadline = time.monotonic() + 20
    i = 0
    while i < 8 or (len(replicas) < 2 and time.monotonic() < deadline):
        status, body, replica = post(router.url + "/v1/embeddings", {"model": "m", "input": ["alpha beta", f"gamma {i}"]})
        assert status == 200 and len(body["data"]) == 2, body
        vectors.append(body["data"][0]["embedding"])
        replicas.add(replica)
        i += 1
    assert len(replicas) == 2, replicas  # both replicas answered, with the same vector for the same text
    assert all(max(abs(a - b) for a, b in zip(v, vectors[0])) < 1e-5 for v in vectors)
    status, body, _ = post(router.url + "/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "b", "c"]})
    assert status == 200 and sorted(r["index"] for r in body["results"]) == [0, 1, 2], body
    status, body, _ = post(router.url + "/v1/score", {"model": "m", "text_1": "a", "text_2": ["b", "c"]})
    assert status == 200 and len(body["data"]) == 2, body
    status, body, _ = post(router.url + "/v1/embeddings", {"model": "m", "input": ""})
    assert status == 400 and body["error"]["param"] == "input", body

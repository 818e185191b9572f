"""Hostile bytes on every tcp port of a running stack, while eight streams run.

The five services run as compose runs them (``FOLIO_ENDPOINTS=tcp``, each with its own share of
the stack's key folder: its own server secret alone), on 127.0.0.1 (``folio.testing.tcpstack``). For every tcp port (each service's sockets and the prefill
executor's KV transfer port): a peer without a key and a peer with a wrong key send admin verbs and
a KV pull; a peer with the right key sends garbage (random bytes, truncated msgpack, a valid
message of the wrong type, a 100 MB frame); many connections are opened and dropped. Then: the
strangers got nothing, every service still runs, every stream equals its solo output, and each
service's log says what it refused.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import urllib.request

import pytest
import zmq

from folio.shared.config import ENDPOINT_OWNERS, Endpoints
from folio.shared.keys import StackKeys, init_keys
from folio.shared.messages import AbortRequest, AdminRequest
from folio.shared.curve import secure
from folio.shared.transport import encode
from folio.testing.models import write_tiny_chat_model
from folio.testing.tcpstack import TcpStack

pytestmark = pytest.mark.slow

PROMPTS = [f"Tell me about {w}." for w in ("rivers", "stars", "bread", "cats", "rain", "glass", "maps", "bells")]
MAX_TOKENS = 128
NUM_CONNECTIONS = 10_000  # opened and dropped across the ports (0.6 s for 10,000 against 14 CURVE sockets)
BIG_FRAME = 100 * 1024 * 1024


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_tokenizer_dir, stack_keys_dir):
    model = write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm_tokenizer_dir)
    s = TcpStack(model, stack_keys_dir, executor_flags=("--batch-invariant",)).start()
    yield s
    codes = s.stop()
    assert all(c == 0 for c in codes.values()), codes


def chat(stack: TcpStack, prompt: str, stream: bool = True) -> str:
    body = {"model": os.path.basename(stack.model), "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(f"{stack.http}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            return json.load(resp)["choices"][0]["message"]["content"]
        text = []
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        return "".join(text)


def _stranger(ctx: zmq.Context, port: int, server_key: bytes, kind: int = zmq.DEALER, key: bool = False) -> zmq.Socket:
    """A socket to ``port`` with no CURVE at all, or (``key``) with a key pair of its own."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if key:
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_key
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _kind_for(name: str) -> int:
    """The socket type that talks to the bound one (PULL <- PUSH, ROUTER <- DEALER, PUB <- SUB)."""
    if name.endswith("_in"):
        return zmq.PUSH
    return zmq.SUB if name == "kv_events" else zmq.DEALER


attacker_started: list[float] = []


def owner(name: str) -> str:
    """The service that binds the port ``name`` of ``TcpStack.ports()`` (whose key it serves with)."""
    return "executor" if name == "kv_transfer" else ENDPOINT_OWNERS[name]


def attack(stack: TcpStack, keys: StackKeys) -> dict:
    """Every port, every intruder; what the strangers received, by port."""
    attacker_started.append(time.monotonic())
    ctx = zmq.Context()
    got: dict[str, int] = {}
    strangers = []
    drain = encode(AdminRequest(command="drain"))
    for name, port in stack.ports().items():
        kind = _kind_for(name)
        for key in (False, True):
            sock = _stranger(ctx, port, keys.server_public(owner(name)), kind, key=key)
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            elif name == "kv_transfer":
                sock.send_multipart([b"PULL", encode({"transfer_id": "0" * 32, "layout": {}})], zmq.NOBLOCK)
            else:
                sock.send(drain, zmq.NOBLOCK)
            strangers.append((name, sock))
    # the right key, garbage frames
    insiders = []
    for name, port in stack.ports().items():
        kind = _kind_for(name)
        if kind == zmq.SUB:
            continue
        sock = ctx.socket(kind)
        sock.linger = 0
        secure(ctx, sock, f"tcp://127.0.0.1:{port}", bind=False, service=owner(name))
        sock.connect(f"tcp://127.0.0.1:{port}")
        wrong_type = encode(AbortRequest(req_id="nobody")) if name.startswith("admin") else \
            encode(AdminRequest(command="stats"))
        for frame in (os.urandom(64), drain[:-3], wrong_type, b"\x00" * BIG_FRAME):
            sock.send(frame, copy=False)
        insiders.append(sock)
    # connections opened and dropped
    ports = list(stack.ports().values())
    reset = struct.pack("ii", 1, 0)  # closed with a reset: no TIME_WAIT left holding 10,000 local ports
    for i in range(NUM_CONNECTIONS):  # plain tcp: half a ZMTP greeting, then gone
        with socket.create_connection(("127.0.0.1", ports[i % len(ports)]), timeout=5) as s:
            s.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
    time.sleep(1.0)
    for name, sock in strangers:
        n = 0
        while sock.poll(0):
            sock.recv_multipart()
            n += 1
        got[name] = got.get(name, 0) + n
        sock.close()
    for sock in insiders:
        sock.close()
    ctx.term()
    return got


def test_strangers_get_nothing_and_every_stream_equals_its_solo_output(stack):
    solo = [chat(stack, p) for p in PROMPTS]
    assert all(solo)
    keys = init_keys(stack.keys_dir)
    outputs: list[str | None] = [None] * len(PROMPTS)

    def run(i):
        outputs[i] = chat(stack, PROMPTS[i])

    got: dict = {}
    attacker = threading.Thread(target=lambda: got.update(attack(stack, keys)))
    attacker.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    streams_done = time.monotonic()
    attacker.join(timeout=180)
    assert got == {name: 0 for name in stack.ports()}, got
    assert attacker_started[0] < streams_done
    assert stack.alive(), stack.log_text()
    assert outputs == solo
    # nothing drained or cleared: a request after the attack is served as before it
    assert chat(stack, PROMPTS[0], stream=False) == solo[0]
    for name in stack.procs:  # each service says what it refused: keyless handshakes, unknown keys
        assert "peer refused" in stack.log_text(name), name
    assert "unknown key" in stack.log_text()


def test_the_admin_cli_refuses_a_tcp_endpoint_without_keys(stack, tmp_path):
    import subprocess
    import sys

    env = {**stack.env(), "FOLIO_CACHE_DIR": str(tmp_path)}
    env.pop("FOLIO_KEYS_DIR")
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "scheduler", "drain"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "folio keys init" in r.stderr, r.stderr
    # with the stack's keys the same command is the operator's, and works
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "scheduler", "stats", "--keys-dir", stack.keys_dir],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Endpoints.tcp(stack.base_port, "127.0.0.1").admin_scheduler.startswith("tcp://")

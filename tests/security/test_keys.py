"""The key folder (``folio keys init``), CURVE on one bound socket, and signed transfer handles."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import zmq

from folio.shared import plane
from folio.shared.keys import init_keys, load_keys, sign, verify
from folio.shared.transport import make_socket


def test_init_keeps_existing_keys_and_keeps_them_private(tmp_path):
    folder = tmp_path / "keys"
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "keys", "init", str(folder)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first = load_keys(folder)
    assert init_keys(folder) == first  # idempotent: a compose one-shot runs it on every `up`
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for f in ("server.key_secret", "client.key_secret", "handle.secret"):
        assert stat.S_IMODE(os.stat(folder / f).st_mode) == 0o600, f
    assert first.client_public in first.allowed and first.server_public != first.client_public
    (folder / "server.key_secret").unlink()  # a lost key is made again, the others kept
    again = init_keys(folder)
    assert again.server_public != first.server_public and again.client_secret == first.client_secret


def test_serve_reads_a_complete_key_folder_without_writing_to_it(tmp_path, monkeypatch):
    """The compose stack mounts its keys read-only into each `folio serve` container (scale-out
    replicas, prefill and decode instances): a complete folder is used as it is."""
    import argparse
    import errno

    from folio.services.serve import own_keys

    folder = tmp_path / "keys"
    init_keys(folder)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(folder))

    for name in ("chmod", "mkdir", "link"):
        monkeypatch.setattr(os, name, read_only)
    monkeypatch.setattr("tempfile.mkdtemp", read_only)
    assert own_keys(argparse.Namespace(keys_dir=str(folder))) == str(folder)
    monkeypatch.undo()
    (folder / "handle.secret").unlink()  # an incomplete folder still gets its missing keys
    assert own_keys(argparse.Namespace(keys_dir=str(folder))) == str(folder)
    assert load_keys(folder).handle_secret


def test_a_tcp_socket_without_keys_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("FOLIO_KEYS_DIR")
    monkeypatch.setenv("FOLIO_CACHE_DIR", str(tmp_path))  # no folder of `folio serve`'s either
    monkeypatch.setattr(plane, "_state", {"keys": None, "set": False})
    ctx = zmq.Context()
    with pytest.raises(plane.MissingKeys, match="folio keys init"):
        make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*")
    make_socket(ctx, zmq.PULL, f"ipc://{tmp_path}/x.sock").close()  # ipc needs none
    ctx.term()
    env = {**os.environ, "FOLIO_ENDPOINTS": "tcp", "FOLIO_TCP_HOST": "127.0.0.1", "FOLIO_CACHE_DIR": str(tmp_path)}
    env.pop("FOLIO_KEYS_DIR", None)
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "run", "kvmanager"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "folio keys init" in r.stdout + r.stderr


def test_a_wrong_key_gets_nothing_and_is_logged(stack_keys_dir):
    keys = load_keys(stack_keys_dir)
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*")
    address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
    friend = make_socket(ctx, zmq.DEALER, address)
    stranger = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    stranger.curve_publickey, stranger.curve_secretkey, stranger.curve_serverkey = public, secret, keys.server_public
    stranger.linger = 0
    stranger.connect(address)
    before = plane.REFUSALS.num_refused
    stranger.send(b"let me in")
    friend.send(b"hello")
    assert server.poll(5000) and server.recv_multipart()[1] == b"hello"
    assert not server.poll(500)  # the stranger's message never arrives
    assert plane.REFUSALS.num_refused > before
    for s in (stranger, friend, server):
        s.close(0)
    plane.release(ctx)
    ctx.term()


def _plain_dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A peer with no CURVE at all."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    return sock


def test_a_keyless_peer_is_refused_unless_curve_is_turned_off(stack_keys_dir, monkeypatch):
    monkeypatch.delenv(plane.UNSAFE_ENV, raising=False)
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*")
    address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
    _plain_dealer(ctx, address).send(b"let me in")
    assert not server.poll(700)  # CURVE: a keyless peer's handshake fails, nothing is read
    monkeypatch.setenv(plane.UNSAFE_ENV, "1")  # the opt-out that measures CURVE's cost
    clear = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*")
    peer = _plain_dealer(ctx, clear.getsockopt(zmq.LAST_ENDPOINT).decode())
    peer.send(b"hello")
    assert clear.poll(5000) and clear.recv_multipart()[1] == b"hello"
    assert clear.curve_server == 0 and server.curve_server == 1
    for s in (peer, clear, server):
        s.close(0)
    plane.release(ctx)
    ctx.term()


def test_a_service_without_curve_serves_tcp_in_the_clear_and_says_so(tmp_path):
    """``FOLIO_UNSAFE_NO_CURVE=1``: a service starts on tcp without a key folder, warns loudly,
    and answers a peer with no key at all."""
    import time

    from folio.testing.tcpstack import free_port_run

    base = free_port_run(16)
    env = {**os.environ, "FOLIO_ENDPOINTS": "tcp", "FOLIO_TCP_HOST": "127.0.0.1", "FOLIO_BASE_PORT": str(base),
           "FOLIO_CACHE_DIR": str(tmp_path), plane.UNSAFE_ENV: "1"}
    env.pop("FOLIO_KEYS_DIR", None)
    log = tmp_path / "kvmanager.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "folio.cli.main", "run", "kvmanager"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    from folio.shared.config import Endpoints
    from folio.shared.messages import AdminReply, AdminRequest
    from folio.shared.transport import Decoder, encode

    ctx = zmq.Context()
    try:
        peer = _plain_dealer(ctx, Endpoints.tcp(base, "127.0.0.1").admin_kvmanager)
        deadline, reply = time.monotonic() + 60, None
        while reply is None and time.monotonic() < deadline and proc.poll() is None:
            peer.send(encode(AdminRequest(command="ping")))
            if peer.poll(500):
                reply = Decoder(AdminReply).decode(peer.recv_multipart()[-1])
        peer.close(0)
        assert reply is not None and reply.ok and reply.data["pong"], log.read_text()
        assert "FOLIO_UNSAFE_NO_CURVE is set" in log.read_text() and "NO CURVE" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        ctx.term()


def test_signed_handles(stack_keys_dir, tmp_path):
    keys = load_keys(stack_keys_dir)
    handle = {"transfer_id": "t1", "endpoint": "tcp://p:1", "num_blocks": 2, "num_tokens": 20}
    signed = sign(keys, handle, ttl_s=60, now=1000.0)
    assert verify(keys, signed, now=1059.0) == handle
    with pytest.raises(ValueError, match="expired"):
        verify(keys, signed, now=1061.0)
    with pytest.raises(ValueError, match="does not match"):
        verify(keys, {**signed, "num_blocks": 3}, now=1000.0)
    with pytest.raises(ValueError, match="not signed"):
        verify(keys, handle, now=1000.0)
    other = init_keys(tmp_path / "other")  # another stack's key signs nothing here
    with pytest.raises(ValueError, match="does not match"):
        verify(keys, sign(other, handle, 60, now=1000.0), now=1000.0)

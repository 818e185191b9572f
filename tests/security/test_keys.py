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

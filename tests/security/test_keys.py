"""The key folder (``folio keys init``, ``folio keys split``), CURVE on one bound socket with its
service's own server key, and signed transfer handles."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import zmq

from folio.shared import curve
from folio.shared.keys import SERVICES, KeysError, init_keys, load_keys, sign, split_keys, verify
from folio.shared.transport import make_socket


def test_init_keeps_existing_keys_and_keeps_them_private(tmp_path):
    folder = tmp_path / "keys"
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "keys", "init", str(folder)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first = load_keys(folder)
    assert init_keys(folder) == first  # idempotent: a compose one-shot runs it on every `up`
    for d in (folder, folder / "services", folder / "clients"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    secret_files = [f"services/{name}.key_secret" for name in SERVICES] + ["client.key_secret", "handle.secret"]
    for f in secret_files:
        assert stat.S_IMODE(os.stat(folder / f).st_mode) == 0o600, f
    # one server pair per service, each its own, none the client's
    publics = [first.server_public(name) for name in SERVICES]
    assert len(set(publics + [first.client_public])) == len(SERVICES) + 1
    assert first.client_public in first.allowed
    for name in SERVICES:  # the public file says what the secret derives
        assert zmq.auth.load_certificate(str(folder / "services" / f"{name}.key"))[0] == first.server_public(name)
    (folder / "services" / "scheduler.key_secret").unlink()  # a lost pair is made again, the others kept
    (folder / "services" / "scheduler.key").unlink()
    again = init_keys(folder)
    assert again.server_public("scheduler") != first.server_public("scheduler")
    assert again.server_public("gateway") == first.server_public("gateway") and again.client_secret == first.client_secret


def test_a_folder_made_before_the_service_keys_gets_them_on_its_next_init(tmp_path):
    folder = tmp_path / "keys"
    old = init_keys(folder)
    import shutil

    shutil.rmtree(folder / "services")  # what `folio keys init` made before: one server pair for all
    zmq.auth.create_certificates(str(folder), "server")
    with pytest.raises(KeysError, match="gateway.key"):
        load_keys(folder, service="gateway")
    new = init_keys(folder)
    assert new.client_secret == old.client_secret and new.handle_secret == old.handle_secret
    assert sorted(load_keys(folder, service="gateway").secrets) == sorted(SERVICES)


def test_init_races_leave_one_consistent_pair_per_service(tmp_path):
    """Two `folio keys init` on one folder at once (two compose projects' one-shots): every public
    file is the key its secret derives."""
    folder = tmp_path / "keys"
    procs = [subprocess.Popen([sys.executable, "-m", "folio.cli.main", "keys", "init", str(folder)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(3)]
    assert all(p.wait(timeout=60) == 0 for p in procs), [p.stderr.read() for p in procs]
    keys = load_keys(folder)
    for name in SERVICES:
        assert zmq.auth.load_certificate(str(folder / "services" / f"{name}.key"))[0] == keys.server_public(name)


def test_a_split_folder_holds_its_own_service_secret_and_no_other(tmp_path):
    folder, out = tmp_path / "keys", tmp_path / "tokenizer"
    full = init_keys(folder)
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "keys", "split", str(folder), str(out),
                        "--service", "tokenizer"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    secrets = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and "secret" in p.name)
    assert secrets == ["client.key_secret", "services/tokenizer.key_secret"]  # no handle.secret either
    part = load_keys(out, service="tokenizer")
    assert part.secrets == {"tokenizer": full.secrets["tokenizer"]} and part.services == full.services
    assert part.allowed == full.allowed and part.client_secret == full.client_secret
    assert part.handle_secret is None
    with pytest.raises(KeysError, match="scheduler.key_secret is missing.*folio keys split"):
        load_keys(out, service="scheduler")
    with pytest.raises(KeysError, match="handle.secret"):
        sign(part, {"transfer_id": "t"}, 60)
    # split again into the same folder for another service: the first one's secret is gone
    split_keys(folder, out, ["gateway"])
    assert sorted(load_keys(out).secrets) == ["gateway"] and load_keys(out).handle_secret == full.handle_secret
    assert not (out / "services" / "tokenizer.key_secret").exists()
    # a service started on another's folder stops at once, naming the file and the command
    env = {**os.environ, "FOLIO_ENDPOINTS": "tcp", "FOLIO_TCP_HOST": "127.0.0.1", "FOLIO_KEYS_DIR": str(out)}
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "run", "kvmanager"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "kvmanager.key_secret is missing" in r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "folio.cli.main", "keys", "split", str(out), str(tmp_path / "x"),
                        "--service", "gateway"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not a stack's whole folder" in r.stderr  # a split folder splits no further
    with pytest.raises(KeysError, match="a folder of its own"):
        split_keys(folder, folder, ["gateway"])  # which would drop the other services' secrets
    assert sorted(load_keys(folder).secrets) == sorted(SERVICES)


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
    monkeypatch.setattr(curve, "_state", {"keys": None, "set": False, "service": None})
    ctx = zmq.Context()
    with pytest.raises(curve.MissingKeys, match="folio keys init"):
        make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", service="kvmanager")
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
    server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", service="kvmanager")
    address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
    friend = make_socket(ctx, zmq.DEALER, address, service="kvmanager")
    stranger = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    stranger.curve_publickey, stranger.curve_secretkey = public, secret
    stranger.curve_serverkey = keys.server_public("kvmanager")
    stranger.linger = 0
    stranger.connect(address)
    before = curve.REFUSALS.num_refused
    stranger.send(b"let me in")
    friend.send(b"hello")
    assert server.poll(5000) and server.recv_multipart()[1] == b"hello"
    assert not server.poll(500)  # the stranger's message never arrives
    assert curve.REFUSALS.num_refused > before
    for s in (stranger, friend, server):
        s.close(0)
    curve.release(ctx)
    ctx.term()


def test_a_client_that_checks_another_services_key_gets_no_handshake(stack_keys_dir):
    """A socket bound as the kvmanager serves with the kvmanager's key (as the scheduler, with the
    scheduler's): a client expecting any other service there never gets a message through."""
    ctx = zmq.Context()
    try:
        for bound in ("kvmanager", "scheduler"):
            server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", service=bound)
            address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
            for other in set(SERVICES) - {bound}:
                wrong = make_socket(ctx, zmq.DEALER, address, service=other)
                wrong.send(b"are you the " + other.encode())
                assert not server.poll(300), (bound, other)
                wrong.close(0)
            right = make_socket(ctx, zmq.DEALER, address, service=bound)
            right.send(b"hello")
            assert server.poll(5000) and server.recv_multipart()[1] == b"hello", bound
            for s in (right, server):
                s.close(0)
    finally:
        curve.release(ctx)
        ctx.destroy(linger=0)


def _rogue_server(ctx: zmq.Context, public: bytes, secret: bytes) -> tuple[zmq.Socket, str]:
    """A ROUTER serving CURVE with the given pair, letting any client in (no ZAP handler)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.curve_server, sock.curve_publickey, sock.curve_secretkey = True, public, secret
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def test_a_service_secret_cannot_serve_as_another_service(stack_keys_dir, tmp_path):
    """What a compromised tokenizer holds (its split folder) lets it answer as the tokenizer only: a
    client dialling the scheduler, the executor or the kvmanager gets no handshake from it, and the
    folder cannot even bind as them."""
    split_keys(stack_keys_dir, tmp_path / "tokenizer", ["tokenizer"])
    stolen = load_keys(tmp_path / "tokenizer", service="tokenizer")
    ctx = zmq.Context()
    try:
        rogue, address = _rogue_server(ctx, stolen.server_public("tokenizer"), stolen.server_secret("tokenizer"))
        for victim in ("scheduler", "executor", "kvmanager"):
            client = make_socket(ctx, zmq.DEALER, address, service=victim)
            client.send(b"a step plan")
            assert not rogue.poll(500), victim
            client.close(0)
        control = make_socket(ctx, zmq.DEALER, address, service="tokenizer")  # the rogue as itself: served
        control.send(b"hello")
        assert rogue.poll(5000) and rogue.recv_multipart()[1] == b"hello"
        with pytest.raises(KeysError, match="scheduler.key_secret is missing"):
            curve.secure(ctx, ctx.socket(zmq.ROUTER), "tcp://127.0.0.1:*", bind=True, keys=stolen, service="scheduler")
    finally:
        curve.release(ctx)
        ctx.destroy(linger=0)


def test_every_endpoint_has_an_owner_with_a_key():
    """Each endpoint's binder is a service of the key folder (the key its dialers check), and the
    tcp layout's hosts are those owners."""
    from dataclasses import fields

    from folio.shared.config import ENDPOINT_OWNERS, Endpoints

    assert list(ENDPOINT_OWNERS) == [f.name for f in fields(Endpoints)]
    assert set(ENDPOINT_OWNERS.values()) <= set(SERVICES)
    tcp = Endpoints.tcp(5550)
    for name, owner in ENDPOINT_OWNERS.items():
        address = getattr(tcp, name)
        assert address.startswith(f"tcp://{owner}:") and tcp.owner(address) == owner
    with pytest.raises(KeyError):
        tcp.owner("tcp://elsewhere:1")


def test_an_unnamed_service_is_an_error_never_a_shared_key(stack_keys_dir):
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="needs the service that binds it"):
            make_socket(ctx, zmq.DEALER, "tcp://127.0.0.1:5")  # whose key would it check?
        with pytest.raises(KeysError, match="no service of the stack"):  # a process that is no service binds no tcp
            make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*")
        with pytest.raises(KeysError, match="not a service"):
            make_socket(ctx, zmq.DEALER, "tcp://127.0.0.1:5", service="postgres")
        make_socket(ctx, zmq.DEALER, "ipc:///nonexistent/x.sock").close(0)  # ipc: nothing to check
    finally:
        curve.release(ctx)
        ctx.destroy(linger=0)


def _plain_dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A peer with no CURVE at all."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    return sock


def test_a_keyless_peer_is_refused_unless_curve_is_turned_off(stack_keys_dir, monkeypatch):
    monkeypatch.delenv(curve.UNSAFE_ENV, raising=False)
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", service="kvmanager")
    address = server.getsockopt(zmq.LAST_ENDPOINT).decode()
    _plain_dealer(ctx, address).send(b"let me in")
    assert not server.poll(700)  # CURVE: a keyless peer's handshake fails, nothing is read
    monkeypatch.setenv(curve.UNSAFE_ENV, "1")  # the opt-out that measures CURVE's cost
    clear = make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", service="kvmanager")
    peer = _plain_dealer(ctx, clear.getsockopt(zmq.LAST_ENDPOINT).decode())
    peer.send(b"hello")
    assert clear.poll(5000) and clear.recv_multipart()[1] == b"hello"
    assert clear.curve_server == 0 and server.curve_server == 1
    for s in (peer, clear, server):
        s.close(0)
    curve.release(ctx)
    ctx.term()


def test_a_service_without_curve_serves_tcp_in_the_clear_and_says_so(tmp_path):
    """``FOLIO_UNSAFE_NO_CURVE=1``: a service starts on tcp without a key folder, warns loudly,
    and answers a peer with no key at all."""
    import time

    from folio.testing.tcpstack import free_port_run

    base = free_port_run(16)
    env = {**os.environ, "FOLIO_ENDPOINTS": "tcp", "FOLIO_TCP_HOST": "127.0.0.1", "FOLIO_BASE_PORT": str(base),
           "FOLIO_CACHE_DIR": str(tmp_path), curve.UNSAFE_ENV: "1"}
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

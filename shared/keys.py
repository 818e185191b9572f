"""The stack's keys: CURVE key pairs for every tcp socket, and the secret that signs KV transfer handles.

One folder per stack (``folio keys init DIR``; ``--keys-dir`` or ``$FOLIO_KEYS_DIR``; in Kubernetes a
Secret, in compose a volume filled by a one-shot ``folio keys init /keys``):

- ``server.key_secret`` / ``server.key``: the key pair every bound tcp socket serves with (ZeroMQ's
  certificate format, ``zmq.auth``);
- ``client.key_secret`` / ``client.key``: the key pair every connecting socket presents;
- ``clients/*.key``: the public keys a bound socket lets in (``client.key`` is copied there; a
  deployment adds more, one file a peer);
- ``handle.secret``: 32 random bytes (hex), the HMAC key of signed transfer handles (``sign``/``verify``);
- ``peers/NAME.key_secret`` / ``peers/NAME.key`` (``folio keys init DIR --peer NAME``): a client key
  pair of its own for one instance (a decode instance: a KV transfer is served only to the key its
  handle names), its public key also in ``clients/NAME.key``. A process presents it instead of
  ``client.key`` with ``FOLIO_PEER_KEY=NAME``.

``init_keys`` keeps whatever is already there (a compose one-shot runs it on every ``up``), writes
each missing file under a temporary name and links it into place, so two starts racing on one folder
never leave half a key. A public key is always derived from its secret when loaded, never trusted
from its own file. ``shared/transport.py`` reads the folder (``load_keys``); ``folio serve`` on one
host makes one itself.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from folio.shared.config import peer_key_from_env

_PAIRS = ("server", "client")
HANDLE_SECRET = "handle.secret"
PEER_ENV = "FOLIO_PEER_KEY"
_PEER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class KeysError(RuntimeError):
    """The key folder is missing, incomplete or unreadable; the message says what to do."""


@dataclass(frozen=True)
class StackKeys:
    folder: str
    server_public: bytes  # z85
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed: frozenset[bytes]  # z85 public keys a bound socket lets in
    handle_secret: bytes
    peer: str | None = None  # the peers/ pair presented as the client key, when one is

    def public_of(self, name: str) -> bytes:
        """The z85 public key ``clients/NAME.key`` lets in (``KeysError`` when there is none)."""
        path = Path(self.folder) / "clients" / f"{_check_peer(name)}.key"
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise KeysError(f"{path}: {exc} (make it with `folio keys init {self.folder} --peer {name}`)") from None
        return public


def _check_peer(name: str) -> str:
    if not _PEER_NAME.match(name or "") or name == "client":
        raise KeysError(f"{name!r} is not a peer key's name (letters, digits, '_', '.', '-'; not 'client')")
    return name


def init_peer(folder: str | os.PathLike, name: str) -> bytes:
    """A key pair of its own for one instance (kept when it exists), let in by the stack; its public key."""
    d = Path(folder)
    _check_peer(name)
    (d / "peers").mkdir(exist_ok=True)
    os.chmod(d / "peers", 0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=d))
    try:
        if not (d / "peers" / f"{name}.key_secret").exists():
            zmq.auth.create_certificates(str(tmp), name)
            _link(tmp / f"{name}.key_secret", d / "peers" / f"{name}.key_secret")
            _link(tmp / f"{name}.key", d / "peers" / f"{name}.key")
        os.chmod(d / "peers" / f"{name}.key_secret", 0o600)
        _, secret = zmq.auth.load_certificate(str(d / "peers" / f"{name}.key_secret"))
        public = zmq.curve_public(secret)
        if not (d / "clients" / f"{name}.key").exists():
            _public_file(tmp / "allowed.key", public)
            _link(tmp / "allowed.key", d / "clients" / f"{name}.key")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public


def init_keys(folder: str | os.PathLike) -> StackKeys:
    """Make the folder's missing keys (existing ones are kept); the folder is 0700, secrets 0600."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    (d / "clients").mkdir(exist_ok=True)
    os.chmod(d / "clients", 0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=d))
    try:
        for name in _PAIRS:
            if not (d / f"{name}.key_secret").exists():
                zmq.auth.create_certificates(str(tmp), name)
                # the secret first: once it is in place the pair is decided (the public is derived)
                _link(tmp / f"{name}.key_secret", d / f"{name}.key_secret")
                _link(tmp / f"{name}.key", d / f"{name}.key")
        if not (d / HANDLE_SECRET).exists():
            (tmp / HANDLE_SECRET).write_text(secrets.token_hex(32) + "\n")
            _link(tmp / HANDLE_SECRET, d / HANDLE_SECRET)
        keys = load_keys(d, allow_missing_clients=True, peer="")
        allowed = d / "clients" / "client.key"
        if not allowed.exists():
            _public_file(tmp / "client.key", keys.client_public)
            _link(tmp / "client.key", allowed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for f in d.glob("*.key_secret"):
        os.chmod(f, 0o600)
    os.chmod(d / HANDLE_SECRET, 0o600)
    return load_keys(d, peer="")


def _link(src: Path, dst: Path) -> None:
    """``src`` at ``dst`` unless something is there already (a link is atomic and never overwrites)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        pass


def _public_file(path: Path, public: bytes) -> None:
    path.write_text('metadata\ncurve\n    public-key = "%s"\n' % public.decode("ascii"))


def load_keys(folder: str | os.PathLike, allow_missing_clients: bool = False, peer: str | None = None) -> StackKeys:
    """The folder's keys; ``KeysError`` naming what is missing. ``peer`` (default ``$FOLIO_PEER_KEY``):
    present ``peers/PEER``'s pair as the client key."""
    d = Path(folder)
    if not d.is_dir():
        raise KeysError(f"no key folder at {d}: make one with `folio keys init {d}`")
    peer = peer if peer is not None else peer_key_from_env()
    pairs = {}
    for name in _PAIRS:
        path = d / f"{name}.key_secret"
        if name == "client" and peer:
            path = d / "peers" / f"{_check_peer(peer)}.key_secret"
        try:
            _, secret = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            hint = f" --peer {peer}" if name == "client" and peer else ""
            raise KeysError(f"{path}: {exc} (make the folder's keys with `folio keys init {d}{hint}`)") from None
        if secret is None:
            raise KeysError(f"{path} holds no secret key")
        pairs[name] = (zmq.curve_public(secret), secret)
    try:
        handle_secret = bytes.fromhex((d / HANDLE_SECRET).read_text().strip())
    except (OSError, ValueError) as exc:
        raise KeysError(f"{d / HANDLE_SECRET}: {exc} (make it with `folio keys init {d}`)") from None
    allowed = set()
    for path in sorted((d / "clients").glob("*.key")) if (d / "clients").is_dir() else ():
        public, _ = zmq.auth.load_certificate(str(path))
        if public:
            allowed.add(public)
    if not allowed and not allow_missing_clients:
        raise KeysError(f"{d / 'clients'} lets no client in (make it with `folio keys init {d}`)")
    return StackKeys(folder=str(d), server_public=pairs["server"][0], server_secret=pairs["server"][1],
                     client_public=pairs["client"][0], client_secret=pairs["client"][1],
                     allowed=frozenset(allowed), handle_secret=handle_secret, peer=peer or None)


# --------------------------------------------------------------------------- signed handles


def sign(keys: StackKeys, payload: dict, ttl_s: float, now: float | None = None) -> dict:
    """``payload`` with an expiry and an HMAC-SHA256 over both (a transfer handle the router hands
    a decode instance: only a holder of the stack's key can make one)."""
    body = {**payload, "expires": round((time.time() if now is None else now) + ttl_s, 3)}
    body.pop("signature", None)
    return {**body, "signature": _mac(keys, body)}


def verify(keys: StackKeys, signed: dict, now: float | None = None) -> dict:
    """The payload of a handle ``sign`` made, or ``ValueError`` saying why it is refused."""
    if not isinstance(signed, dict) or not isinstance(signed.get("signature"), str):
        raise ValueError("the handle is not signed by the router")
    body = {k: v for k, v in signed.items() if k != "signature"}
    if not hmac.compare_digest(_mac(keys, body), signed["signature"]):
        raise ValueError("the handle's signature does not match")
    expires = body.get("expires")
    if not isinstance(expires, (int, float)) or expires < (time.time() if now is None else now):
        raise ValueError("the handle has expired")
    body.pop("expires")
    return body


def _mac(keys: StackKeys, body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(keys.handle_secret, canonical, hashlib.sha256).hexdigest()

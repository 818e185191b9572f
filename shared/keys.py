"""The stack's keys: CURVE key pairs for every tcp socket, and the secret that signs KV transfer handles.

More in docs/modules.md (shared/keys.py).
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
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from folio.shared.config import peer_key_from_env

SERVICES = ("gateway", "tokenizer", "scheduler", "kvmanager", "executor", "router")
HANDLE_USERS = ("gateway", "router")  # the services that verify or sign transfer handles
HANDLE_SECRET = "handle.secret"
PEER_ENV = "FOLIO_PEER_KEY"
_PEER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class KeysError(RuntimeError):
    """The key folder is missing, incomplete or unreadable; the message says what to do."""


@dataclass(frozen=True)
class StackKeys:
    folder: str
    client_public: bytes  # z85
    client_secret: bytes
    allowed: frozenset[bytes]  # z85 public keys a bound socket lets in
    handle_secret: bytes | None  # None in a folder split for a service that never signs nor verifies
    services: dict[str, bytes]  # service -> the z85 public key its bound sockets serve with
    secrets: dict[str, bytes] = field(default_factory=dict)  # service -> its server secret, those the folder holds
    service: str | None = None  # the service this process is (its secret is in ``secrets``)
    peer: str | None = None  # the peers/ pair presented as the client key, when one is

    def public_of(self, name: str) -> bytes:
        """The z85 public key ``clients/NAME.key`` lets in (``KeysError`` when there is none)."""
        path = Path(self.folder) / "clients" / f"{_check_peer(name)}.key"
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise KeysError(f"{path}: {exc} (make it with `folio keys init {self.folder} --peer {name}`)") from None
        return public

    def server_public(self, service: str) -> bytes:
        """The public key ``service``'s bound sockets show (what a connecting socket checks)."""
        _check_service(service)
        return self.services[service]

    def server_secret(self, service: str) -> bytes:
        """``service``'s server secret; ``KeysError`` naming the file when this folder lacks it."""
        _check_service(service)
        if service not in self.secrets:
            raise KeysError(_missing_secret(Path(self.folder), service))
        return self.secrets[service]


def _check_service(name: str) -> str:
    if name not in SERVICES:
        raise KeysError(f"{name!r} is not a service of the stack ({', '.join(SERVICES)})")
    return name


def _missing_secret(d: Path, service: str) -> str:
    return (f"{d / 'services' / (service + '.key_secret')} is missing: the {service}'s server key (make it with "
            f"`folio keys init DIR` on the stack's folder, then `folio keys split DIR {d} --service {service}`)")


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
        public = _init_pair(d / "peers", name, tmp)
        if not (d / "clients" / f"{name}.key").exists():
            _public_file(tmp / "allowed.key", public)
            _link(tmp / "allowed.key", d / "clients" / f"{name}.key")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public


def _init_pair(d: Path, name: str, tmp: Path) -> bytes:
    """``d/NAME.key_secret`` (kept when it exists) and ``d/NAME.key`` derived from it; the public key.
    The secret goes in first: once it is in place the pair is decided, and whichever racer links the
    public file links the one derived from that secret."""
    if not (d / f"{name}.key_secret").exists():
        zmq.auth.create_certificates(str(tmp), name)
        _link(tmp / f"{name}.key_secret", d / f"{name}.key_secret")
    os.chmod(d / f"{name}.key_secret", 0o600)
    _, secret = zmq.auth.load_certificate(str(d / f"{name}.key_secret"))
    public = zmq.curve_public(secret)
    if not (d / f"{name}.key").exists():
        _public_file(tmp / f"{name}.public", public)
        _link(tmp / f"{name}.public", d / f"{name}.key")
    return public


def init_keys(folder: str | os.PathLike) -> StackKeys:
    """Make the folder's missing keys (existing ones are kept); the folders are 0700, secrets 0600."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for sub in ("clients", "services"):
        (d / sub).mkdir(exist_ok=True)
        os.chmod(d / sub, 0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=d))
    try:
        client_public = _init_pair(d, "client", tmp)
        for name in SERVICES:
            _init_pair(d / "services", name, tmp)
        if not (d / HANDLE_SECRET).exists():
            (tmp / HANDLE_SECRET).write_text(secrets.token_hex(32) + "\n")
            _link(tmp / HANDLE_SECRET, d / HANDLE_SECRET)
        allowed = d / "clients" / "client.key"
        if not allowed.exists():
            _public_file(tmp / "client.key", client_public)
            _link(tmp / "client.key", allowed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.chmod(d / HANDLE_SECRET, 0o600)
    return load_keys(d, peer="")


def split_keys(folder: str | os.PathLike, out: str | os.PathLike, services: list[str] | tuple[str, ...],
               peers: list[str] | tuple[str, ...] = ()) -> StackKeys:
    """Write into ``out`` what a process running ``services`` needs of the stack's ``folder``: those
    services' secrets, every service's public key, the client secret (and ``peers``' pairs),
    ``clients/``, and ``handle.secret`` when one of them signs or verifies handles. Files already
    in ``out`` are replaced; another service's secret found there is removed. Returns ``out``'s keys
    as the first of ``services`` reads them."""
    src, d = Path(folder), Path(out)
    if not services:
        raise KeysError("split needs at least one --service NAME")
    for name in services:
        _check_service(name)
    if d.resolve() == src.resolve():
        raise KeysError(f"split writes a folder of its own, not {src} itself")
    full = load_keys(src, peer="")
    missing = [name for name in SERVICES if name not in full.secrets]
    if missing:
        raise KeysError(f"{src} is not a stack's whole folder (no secret of {', '.join(missing)}): split the "
                        f"folder `folio keys init` made")
    files = ["client.key_secret"] + [f"services/{name}.key" for name in SERVICES]
    files += [f"services/{name}.key_secret" for name in services]
    files += [f"clients/{p.name}" for p in sorted((src / "clients").glob("*.key"))]
    for peer in peers:
        files += [f"peers/{_check_peer(peer)}.key_secret", f"peers/{peer}.key"]
    if set(services) & set(HANDLE_USERS):
        files.append(HANDLE_SECRET)
    for sub in ("", "clients", "services") + (("peers",) if peers else ()):
        (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / sub, 0o700)
    for name in SERVICES:  # a folder split before for other services keeps none of their secrets
        if name not in services:
            (d / "services" / f"{name}.key_secret").unlink(missing_ok=True)
    if not set(services) & set(HANDLE_USERS):
        (d / HANDLE_SECRET).unlink(missing_ok=True)
    for rel in files:
        if not (src / rel).exists():
            raise KeysError(f"{src / rel} is missing (make it with `folio keys init {src}`)")
        fd, tmp = tempfile.mkstemp(prefix=".new-", dir=d / Path(rel).parent)
        with os.fdopen(fd, "wb") as f:
            f.write((src / rel).read_bytes())
        os.chmod(tmp, 0o600 if rel.endswith(("_secret", ".secret")) else 0o644)
        os.replace(tmp, d / rel)
    return load_keys(d, service=services[0], peer="")


def _link(src: Path, dst: Path) -> None:
    """``src`` at ``dst`` unless something is there already (a link is atomic and never overwrites)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        pass


def _public_file(path: Path, public: bytes) -> None:
    path.write_text('metadata\ncurve\n    public-key = "%s"\n' % public.decode("ascii"))


def _secret_of(path: Path, hint: str) -> bytes:
    try:
        _, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise KeysError(f"{path}: {exc} ({hint})") from None
    if secret is None:
        raise KeysError(f"{path} holds no secret key")
    return secret


def load_keys(folder: str | os.PathLike, peer: str | None = None, service: str | None = None) -> StackKeys:
    """The folder's keys; ``KeysError`` naming what is missing. ``service``: the service this process
    is, whose secret must be there (``handle.secret`` too for the gateway and the router); other
    services' secrets are read when present. ``peer`` (default ``$FOLIO_PEER_KEY``): present
    ``peers/PEER``'s pair as the client key."""
    d = Path(folder)
    if not d.is_dir():
        raise KeysError(f"no key folder at {d}: make one with `folio keys init {d}`")
    if service is not None:
        _check_service(service)
    peer = peer if peer is not None else peer_key_from_env()
    if peer:
        client = _secret_of(d / "peers" / f"{_check_peer(peer)}.key_secret",
                            f"make it with `folio keys init {d} --peer {peer}`")
    else:
        client = _secret_of(d / "client.key_secret", f"make the folder's keys with `folio keys init {d}`")
    publics, server_secrets = {}, {}
    for name in SERVICES:
        path = d / "services" / f"{name}.key_secret"
        if path.exists():
            server_secrets[name] = _secret_of(path, f"make it with `folio keys init {d}`")
            publics[name] = zmq.curve_public(server_secrets[name])
        elif name == service:
            raise KeysError(_missing_secret(d, name))
        else:
            try:
                publics[name], _ = zmq.auth.load_certificate(str(d / "services" / f"{name}.key"))
            except (OSError, ValueError) as exc:
                raise KeysError(f"{d / 'services' / (name + '.key')}: {exc} (the {name}'s public key: make it "
                                f"with `folio keys init DIR` on the stack's folder, and split a folder of "
                                f"`folio keys split` again)") from None
    handle_secret = None
    if (d / HANDLE_SECRET).exists() or service in HANDLE_USERS:
        try:
            handle_secret = bytes.fromhex((d / HANDLE_SECRET).read_text().strip())
        except (OSError, ValueError) as exc:
            raise KeysError(f"{d / HANDLE_SECRET}: {exc} (make it with `folio keys init {d}`)") from None
    allowed = set()
    for path in sorted((d / "clients").glob("*.key")) if (d / "clients").is_dir() else ():
        public, _ = zmq.auth.load_certificate(str(path))
        if public:
            allowed.add(public)
    if not allowed:
        raise KeysError(f"{d / 'clients'} lets no client in (make it with `folio keys init {d}`)")
    return StackKeys(folder=str(d), client_public=zmq.curve_public(client), client_secret=client,
                     allowed=frozenset(allowed), handle_secret=handle_secret, services=publics,
                     secrets=server_secrets, service=service, peer=peer or None)


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
    if keys.handle_secret is None:
        raise KeysError(f"{Path(keys.folder) / HANDLE_SECRET} is missing: only the gateway's and the router's "
                        "folders hold it (`folio keys split DIR OUT --service gateway`)")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(keys.handle_secret, canonical, hashlib.sha256).hexdigest()

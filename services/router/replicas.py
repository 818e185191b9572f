"""The replicas behind the router: who they are, whether they answer, how loaded they are, and
what their prefix caches hold.

More in docs/modules.md (services/router/replicas.py).
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import structlog
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from folio.services.router.index import KVIndex
from folio.shared.config import RouterConfig, api_key_from_env
from folio.shared.transport import request
from folio.shared.messages import KV_EVENTS_TOPIC, KVEventBatch, KVSnapshot, KVSnapshotRequest
from folio.shared.transport import Decoder, MalformedMessage, make_socket

log = structlog.get_logger()

SNAPSHOT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ServedModel:
    """One entry of a replica's ``/v1/models``: a base model, or an adapter of ``parent``."""

    id: str
    parent: str | None = None  # the base model's id, for an adapter
    root: str | None = None  # a base model's ``--model`` (its folder): where the router finds its tokenizer


@dataclass(eq=False)
class Replica:
    name: str  # its base URL, e.g. http://10.0.0.7:8000
    kv_events: str  # tcp://host:port of its kvmanager's PUB
    kv_snapshot: str  # tcp://host:port of its kvmanager's snapshot ROUTER
    from_dns: bool = False
    peer_key: str | None = None  # ``,key=NAME``: a decode instance's own key (``folio keys init --peer NAME``)
    up: bool = False  # until its first poll answers
    num_inflight: int = 0  # requests this router has sent it that are not done
    num_running: int = 0  # as its /metrics said last
    num_waiting: int = 0
    num_routed: int = 0
    num_failures: int = 0
    num_slow_polls: int = 0  # timed-out polls in a row
    last_error: str = ""
    models: dict[str, ServedModel] | None = None  # its /v1/models as last read; None: not known
    active_adapters: frozenset[str] = frozenset()  # running or waiting on it, as its /metrics said last
    inflight_adapters: dict[str, int] = field(default_factory=dict)  # of the requests this router has there
    went_down: asyncio.Event = field(default_factory=asyncio.Event)  # set when marked down (a fresh one when up)
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def load(self) -> int:
        """Requests it is busy with: its own count, or ours when that is fresher (the poll lags)."""
        return max(self.num_inflight, self.num_running + self.num_waiting)

    def has_adapter_active(self, lora_name: str) -> bool:
        """It is running (or queueing) the adapter: in a device slot, no swap to wait for."""
        return lora_name in self.active_adapters or self.inflight_adapters.get(lora_name, 0) > 0

    def match(self, model: str) -> ServedModel | None:
        """What ``model`` names on this replica: an id it lists, else a base model's ``root`` (the
        gateway also takes its ``--model`` value when it has no ``--served-model-name``)."""
        if self.models is None:
            return None
        entry = self.models.get(model)
        if entry is None:
            entry = next((m for m in self.models.values() if m.parent is None and m.root == model), None)
        return entry


def parse_replica(spec: str, kv_events_port: int, kv_snapshot_port: int, from_dns: bool = False) -> Replica:
    """``URL[,kv_events_port=P][,kv_snapshot_port=Q][,key=NAME]`` -> a Replica; ValueError when
    malformed (``key``: a decode instance's own CURVE key, ``folio keys init DIR --peer NAME``)."""
    url, *options = spec.split(",")
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a replica is an http(s) URL, optionally ',kv_events_port=P,kv_snapshot_port=Q': {spec!r}")
    ports = {"kv_events_port": kv_events_port, "kv_snapshot_port": kv_snapshot_port}
    peer_key = None
    for option in options:
        key, _, value = option.partition("=")
        if key.strip() == "key" and value.strip():
            peer_key = value.strip()
            continue
        if key.strip() not in ports or not value.strip().isdigit():
            raise ValueError(f"unknown replica option {option!r} in {spec!r}")
        ports[key.strip()] = int(value)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return Replica(name=f"{parts.scheme}://{host}:{parts.port or 80}{parts.path}",
                   kv_events=f"tcp://{host}:{ports['kv_events_port']}",
                   kv_snapshot=f"tcp://{host}:{ports['kv_snapshot_port']}", from_dns=from_dns, peer_key=peer_key)


def read_load(metrics_text: str) -> tuple[int, int]:
    """(running, waiting) from a replica's Prometheus text."""
    values = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in ("folio:num_requests_running", "folio:num_requests_waiting"):
                values[sample.name] = values.get(sample.name, 0) + int(sample.value)
    return values.get("folio:num_requests_running", 0), values.get("folio:num_requests_waiting", 0)


def read_models(payload) -> dict[str, ServedModel]:
    """A replica's ``/v1/models`` body -> its entries by id; ValueError when it is not that shape."""
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("not a model list")
    models = {}
    for item in payload["data"]:
        if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"] not in models:
            parent, root = item.get("parent"), item.get("root")
            models[item["id"]] = ServedModel(item["id"], parent if isinstance(parent, str) else None,
                                             root if isinstance(root, str) else None)
    return models


def read_active_adapters(metrics_text: str) -> frozenset[str]:
    """The adapters a replica's ``*lora_requests_info`` gauge says it runs or queues. As vLLM's, one
    sample per state it has been in, its value the time it was set: the latest is the current one."""
    latest: dict[str, tuple[float, frozenset[str]]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if not family.name.endswith("lora_requests_info"):
            continue
        for sample in family.samples:
            names = {n.strip() for key in ("running_lora_adapters", "waiting_lora_adapters")
                     for n in sample.labels.get(key, "").split(",") if n.strip()}
            if family.name not in latest or sample.value >= latest[family.name][0]:
                latest[family.name] = (sample.value, frozenset(names))
    return frozenset().union(*(names for _, names in latest.values()))


class ReplicaSet:
    def __init__(self, config: RouterConfig, index: KVIndex, metrics, ctx: zmq.asyncio.Context):
        self.config = config
        self.index = index
        self.metrics = metrics
        self.ctx = ctx
        self.replicas: dict[str, Replica] = {}
        self.session: aiohttp.ClientSession | None = None
        self._snapshot_decoder = Decoder(KVSnapshot)
        self._batch_decoder = Decoder(KVEventBatch)
        self._resyncing: dict[str, asyncio.Task] = {}
        api_key = api_key_from_env()
        self._models_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._models_asked_at: dict[str, float] = {}  # unknown model -> when it last made the lists be read

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.up]

    # ------------------------------------------------------------------ models
    def serving(self, model: str | None) -> tuple[list[Replica], ServedModel | None]:
        """(the replicas ``model`` may go to, what it is on those that list it). No model: all of
        them. Replicas whose list is not known are included (they answer for themselves); down
        ones too (``routing`` skips them): a model served only by replicas that are down is a
        503, not a 404."""
        if model is None:
            return list(self.replicas.values()), None
        chosen, entry, entry_up = [], None, False
        for replica in self.replicas.values():
            found = replica.match(model)
            if found is not None:
                chosen.append(replica)
                if entry is None or (replica.up and not entry_up):  # a live replica's word first
                    entry, entry_up = found, replica.up
            elif replica.models is None:
                chosen.append(replica)
        return chosen, entry

    def base_models(self) -> dict[str, ServedModel]:
        """Every base model some replica serves, by id."""
        bases: dict[str, ServedModel] = {}
        for replica in self.replicas.values():
            for m in (replica.models or {}).values():
                if m.parent is None:
                    bases.setdefault(m.id, m)
        return bases

    def base_of(self, entry: ServedModel) -> ServedModel:
        """The base model an adapter sits on (itself for a base model)."""
        if entry.parent is None:
            return entry
        return self.base_models().get(entry.parent, ServedModel(entry.parent))

    async def refresh_models(self, model: str, min_interval_s: float) -> None:
        """Read every live replica's model list now, for a request naming ``model``, which no list
        has (an adapter loaded since the last poll): at most once per ``min_interval_s`` for each
        name, so that a client repeating an unknown name cannot make every request re-read the
        lists, while the first request for a newly loaded adapter always finds it."""
        now = asyncio.get_running_loop().time()
        if now - self._models_asked_at.get(model, float("-inf")) < min_interval_s:
            return
        if len(self._models_asked_at) >= 1024:  # forget the names asked longest ago
            self._models_asked_at = {m: t for m, t in self._models_asked_at.items() if now - t < min_interval_s}
        self._models_asked_at[model] = now
        timeout = aiohttp.ClientTimeout(total=self.config.poll_timeout_s, sock_connect=self.config.connect_timeout_s)
        await asyncio.gather(*(self._read_models(r, timeout) for r in self.live()))

    async def _read_models(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> None:
        """Its ``/v1/models``; any failure keeps what was known (liveness is the /metrics poll's)."""
        try:
            async with self.session.get(replica.name + "/v1/models", headers=self._models_headers,
                                        timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                self.set_models(replica, read_models(await resp.json(content_type=None)))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            if replica.models is None:
                log.debug("no model list from the replica; it may take any model", replica=replica.name,
                          error=f"{type(exc).__name__}: {exc}")

    def set_models(self, replica: Replica, models: dict[str, ServedModel]) -> None:
        if replica.models is not None and set(models) == set(replica.models):
            replica.models = models
            return
        before = set(replica.models or ())
        replica.models = models
        self.metrics.set_models(replica.name, models)
        log.info("replica models", replica=replica.name, models=sorted(models),
                 added=sorted(set(models) - before), removed=sorted(before - set(models)))

    async def run(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        for spec in (*self.config.replicas, *self.config.prefill, *self.config.decode):
            self.add(parse_replica(spec, self.config.kv_events_port, self.config.kv_snapshot_port))
        loops = [self._poll_forever()]
        if self.config.replica_dns:
            loops.append(self._discover_forever(self.config.replica_dns))
        try:
            await asyncio.gather(*loops)
        finally:
            for name in list(self.replicas):
                self.remove(name)

    # ------------------------------------------------------------------ membership
    def add(self, replica: Replica) -> None:
        if replica.name in self.replicas:
            return
        self.replicas[replica.name] = replica
        self.index.view(replica.name)
        replica.tasks.append(asyncio.ensure_future(self._follow_events(replica)))
        self.metrics.replica_up.labels(replica.name).set(0)
        log.info("replica added", replica=replica.name, kv_events=replica.kv_events, from_dns=replica.from_dns)

    def remove(self, name: str) -> None:
        replica = self.replicas.pop(name, None)
        if replica is None:
            return
        for task in replica.tasks:
            task.cancel()
        self.index.drop(name)
        self.metrics.forget(name)
        log.info("replica removed", replica=name)

    async def _discover_forever(self, dns: str) -> None:
        host, _, port = dns.rpartition(":")
        loop = asyncio.get_running_loop()
        while True:
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                found = {f"http://{f'[{a[4][0]}]' if a[0] == socket.AF_INET6 else a[4][0]}:{port}" for a in infos}
            except OSError as exc:
                log.warning("replica lookup failed; keeping the replicas known", name=host, error=str(exc))
                found = None
            if found is not None:
                for url in sorted(found - set(self.replicas)):
                    self.add(parse_replica(url, self.config.kv_events_port, self.config.kv_snapshot_port, True))
                for name in [n for n, r in self.replicas.items() if r.from_dns and n not in found]:
                    self.remove(name)
            await asyncio.sleep(self.config.dns_interval_s)

    # ------------------------------------------------------------------ liveness and load
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(r) for r in list(self.replicas.values())))
            await asyncio.sleep(self.config.poll_interval_s)

    async def poll(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.poll_timeout_s, sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.get(replica.name + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                text = await resp.text()
                replica.num_running, replica.num_waiting = read_load(text)
                replica.active_adapters = read_active_adapters(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            # a refused or dropped connection is a dead replica; a slow answer may be a busy one
            slow = isinstance(exc, asyncio.TimeoutError)
            replica.num_slow_polls = replica.num_slow_polls + 1 if slow else 0
            if not slow or replica.num_slow_polls >= self.config.slow_polls_to_down:
                self.mark_down(replica, f"poll: {type(exc).__name__}: {exc}")
            return
        replica.num_slow_polls = 0
        await self._read_models(replica, timeout)  # before it is up: routed by model from its first request
        if not replica.up:
            replica.up, replica.went_down = True, asyncio.Event()
            self.metrics.replica_up.labels(replica.name).set(1)
            log.info("replica up", replica=replica.name)
            self.resync(replica, "up")  # new, or back: what it caches now is its own word

    def mark_down(self, replica: Replica, reason: str) -> None:
        replica.last_error = reason
        if not replica.up:
            return
        replica.up = False
        replica.went_down.set()  # requests it has not begun to answer go elsewhere
        replica.num_failures += 1
        self.metrics.replica_up.labels(replica.name).set(0)
        self.index.mark_stale(replica.name)  # whatever it held may be gone when it comes back
        log.warning("replica down", replica=replica.name, reason=reason)

    # ------------------------------------------------------------------ KV events
    async def _follow_events(self, replica: Replica) -> None:
        sub = make_socket(self.ctx, zmq.SUB, replica.kv_events, service="kvmanager")
        sub.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("malformed kv event frames dropped", replica=replica.name, num_frames=len(frames))
                    continue
                try:
                    batch = self._batch_decoder.decode(frames[2])
                except MalformedMessage as exc:
                    log.warning("malformed kv event batch dropped", replica=replica.name, error=str(exc))
                    continue
                outcome = self.index.apply_batch(replica.name, int.from_bytes(frames[1], "big"), batch)
                self.metrics.event_batches.labels(replica.name, outcome).inc()
                if outcome in ("gap", "restart"):
                    log.info("kv events out of sequence; resyncing", replica=replica.name, cause=outcome)
                    self.resync(replica, outcome)
                self.metrics.indexed_blocks.labels(replica.name).set(len(self.index.view(replica.name).block_hashes))
        finally:
            sub.close(linger=0)

    def resync(self, replica: Replica, cause: str) -> None:
        """Rebuild the replica's view from a snapshot, in the background (events keep buffering)."""
        running = self._resyncing.get(replica.name)
        if running is not None and not running.done():
            return
        if self.index.in_sync(replica.name):
            self.index.mark_stale(replica.name)  # batches that arrive meanwhile wait for the snapshot
        self.metrics.resyncs.labels(replica.name, cause).inc()
        task = asyncio.ensure_future(self._resync(replica))
        self._resyncing[replica.name] = task
        replica.tasks.append(task)
        task.add_done_callback(lambda t: replica.tasks.remove(t) if t in replica.tasks else None)

    async def _resync(self, replica: Replica) -> None:
        dealer = make_socket(self.ctx, zmq.DEALER, replica.kv_snapshot, service="kvmanager")
        try:
            snapshot = await request(dealer, KVSnapshotRequest(), self._snapshot_decoder, log, SNAPSHOT_TIMEOUT_S,
                                     socket_name="kv_snapshot")
        except zmq.ZMQError as exc:
            snapshot, error = None, type(exc).__name__
        else:
            error = "TimeoutError"
        finally:
            dealer.close(linger=0)
        if snapshot is None:
            log.warning("no kv snapshot; the replica's view starts empty", replica=replica.name, error=error)
            if replica.name in self.replicas:
                self.index.start_empty(replica.name)
            return
        if replica.name in self.replicas:
            self.index.apply_snapshot(replica.name, snapshot)
            self.metrics.indexed_blocks.labels(replica.name).set(len(self.index.view(replica.name).block_hashes))
            log.info("kv view rebuilt from a snapshot", replica=replica.name,
                     num_blocks=len(snapshot.block_hashes), next_event_seq=snapshot.next_event_seq)

"""The router's own Prometheus metrics (``GET /metrics``): routing decisions and why, cache-aware
hits, retries, replicas up, the models (and adapters) each serves and the requests routed per
model, and the state of its KV index. Own registry, as the gateway's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.routed = Counter("folio_router:requests_routed", "Attempts sent to a replica, by why it was chosen "
                              "(cache: it holds the longest cached prefix; load: least cost without one; "
                              "round_robin).", ["replica", "reason"], registry=r)
        self.cache_hits = Counter("folio_router:cache_aware_hits", "Requests sent to a replica holding part of "
                                  "their prompt.", registry=r)
        self.cached_tokens = Counter("folio_router:cached_prompt_tokens", "Prompt tokens the chosen replica held, "
                                     "as the index saw it at routing time.", registry=r)
        self.prompt_tokens = Counter("folio_router:prompt_tokens", "Prompt tokens of routed requests.", registry=r)
        self.retries = Counter("folio_router:retries", "Requests tried again on another replica, by the "
                               "replica that failed them and why.", ["replica", "cause"], registry=r)
        self.failed = Counter("folio_router:requests_failed", "Requests no replica could take.", ["cause"],
                              registry=r)
        self.broken_streams = Counter("folio_router:broken_streams", "Streams a replica cut after they began "
                                      "(not retried: the client already has part of the answer).", ["replica"],
                                      registry=r)
        self.replica_up = Gauge("folio_router:replica_up", "1 while the replica answers.", ["replica"], registry=r)
        self.indexed_blocks = Gauge("folio_router:indexed_blocks", "Blocks the index says the replica caches.",
                                    ["replica"], registry=r)
        self.event_batches = Counter("folio_router:kv_event_batches", "KV event batches received, by outcome "
                                     "(applied, buffered, gap, restart).", ["replica", "outcome"], registry=r)
        self.replica_models = Gauge("folio_router:replica_models", "1 for each model (base, or adapter with its "
                                    "parent) the replica's /v1/models lists.", ["replica", "model", "parent"],
                                    registry=r)
        self.model_requests = Counter("folio_router:model_requests", "Requests routed by their model field, by "
                                      "model (and, for an adapter, whether the chosen replica was running it).",
                                      ["model", "adapter_active"], registry=r)
        self._models: dict[str, list[tuple[str, str]]] = {}  # the replica_models labels set, per replica
        self.resyncs = Counter("folio_router:index_resyncs", "Index rebuilds of a replica's view, by cause.",
                               ["replica", "cause"], registry=r)

    def set_models(self, replica: str, models: dict) -> None:
        """The replica's model list (``ServedModel`` by id) as its gauge."""
        self._forget_models(replica)
        self._models[replica] = [(m.id, m.parent or "") for m in models.values()]
        for model, parent in self._models[replica]:
            self.replica_models.labels(replica, model, parent).set(1)

    def _forget_models(self, replica: str) -> None:
        for model, parent in self._models.pop(replica, ()):
            try:
                self.replica_models.remove(replica, model, parent)
            except KeyError:
                pass

    def forget(self, replica: str) -> None:
        """A replica that left: its gauges go (counters keep their history)."""
        for gauge in (self.replica_up, self.indexed_blocks):
            try:
                gauge.remove(replica)
            except KeyError:
                pass
        self._forget_models(replica)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Configuration: frozen dataclasses, and the only place that reads the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PORT = 8000


def cache_dir() -> Path:
    """Where prepared models live: ``$FOLIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/folio``."""
    explicit = os.environ.get("FOLIO_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "folio"


@dataclass(frozen=True)
class RuntimeConfig:
    """What the executor's model runtime needs to start."""

    model: str = DEFAULT_MODEL_NAME  # a model folder, a .gguf file, or the default model's name
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "auto"  # auto (the checkpoint's own) | none | int8 | int4 | awq | fp8
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides any budget
    num_host_blocks: int = 0  # the host tier that swapped-out blocks go to (0: no swapping)
    kv_cache_bytes: int | None = None  # CPU budget; default: a fraction of free memory
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    attention_backend: str = "auto"  # auto | torch | cuda
    # speculative decoding: a draft model folder, or "ngram" (prompt lookup); None: off
    speculative_model: str | None = None
    num_speculative_tokens: int = 0
    ngram_prompt_lookup_max: int = 4  # the longest suffix n-gram looked up
    ngram_prompt_lookup_min: int = 1
    speculative_disable_by_batch_size: int = 0  # no drafts while this many requests sample (0: never off)
    num_draft_kv_blocks: int | None = None  # the draft model's own pool (default: as many as the target's)


@dataclass(frozen=True)
class Endpoints:
    """Where each socket lives. ``ipc://`` under one run folder for ``folio serve``; ``tcp://``
    with service names as hosts for the compose stack."""

    tokenizer_in: str  # PULL, bound by the tokenizer: from the gateway and the scheduler
    scheduler_in: str  # PULL, bound by the scheduler: from the tokenizer
    gateway_in: str  # PULL, bound by the gateway: from the tokenizer
    kvmanager: str  # ROUTER, bound by the kvmanager: the scheduler's and executor's requests
    executor: str  # ROUTER, bound by the executor: the scheduler's step plans
    kv_events: str  # PUB, bound by the kvmanager
    admin_gateway: str
    admin_tokenizer: str
    admin_scheduler: str
    admin_kvmanager: str
    admin_executor: str
    # appended after the first layout, so that its tcp ports stay where they were
    kv_snapshot: str  # ROUTER, bound by the kvmanager: routers ask it for the cache's contents
    admin_router: str

    @staticmethod
    def ipc(run_dir: str | Path) -> "Endpoints":
        d = Path(run_dir)
        names = [f.name for f in Endpoints.__dataclass_fields__.values()]
        return Endpoints(**{n: f"ipc://{d / n}.sock" for n in names})

    @staticmethod
    def tcp(base_port: int = 5550) -> "Endpoints":
        """Container names as hosts, one port each: the compose stack's layout."""
        owner = {
            "tokenizer_in": "tokenizer",
            "scheduler_in": "scheduler",
            "gateway_in": "gateway",
            "kvmanager": "kvmanager",
            "executor": "executor",
            "kv_events": "kvmanager",
            "admin_gateway": "gateway",
            "admin_tokenizer": "tokenizer",
            "admin_scheduler": "scheduler",
            "admin_kvmanager": "kvmanager",
            "admin_executor": "executor",
            "kv_snapshot": "kvmanager",
            "admin_router": "router",
        }
        return Endpoints(**{n: f"tcp://{host}:{base_port + i}" for i, (n, host) in enumerate(owner.items())})

    @staticmethod
    def from_env() -> "Endpoints":
        """``FOLIO_ENDPOINTS=tcp`` (compose) or ``FOLIO_RUN_DIR`` (ipc, default: the folder of a
        server on port 8000); ``FOLIO_KV_EVENTS_ENDPOINT`` / ``FOLIO_KV_SNAPSHOT_ENDPOINT`` move the
        KV event stream and its snapshot socket elsewhere (``folio serve --kv-events-port``: tcp for
        a router)."""
        if os.environ.get("FOLIO_ENDPOINTS", "ipc") == "tcp":
            endpoints = Endpoints.tcp(int(os.environ.get("FOLIO_BASE_PORT", "5550")))
        else:
            endpoints = Endpoints.ipc(default_run_dir(DEFAULT_PORT))
        moved = {name: os.environ.get(var) for name, var in (("kv_events", "FOLIO_KV_EVENTS_ENDPOINT"),
                                                             ("kv_snapshot", "FOLIO_KV_SNAPSHOT_ENDPOINT"))}
        return replace(endpoints, **{name: value for name, value in moved.items() if value})


def log_json_from_env() -> bool:
    return os.environ.get("FOLIO_LOG_JSON", "0") in ("1", "true", "yes")


# --------------------------------------------------------------------------- back-half services


@dataclass(frozen=True)
class KVManagerConfig:
    """The kvmanager: the block allocator behind the scheduler's per-step request."""

    endpoints: Endpoints
    log_json: bool = False
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's batching limits (vLLM's flag names) and where its peers are."""

    endpoints: Endpoints
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length, from the registered pool
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # most tokens one prefill takes per step (0: the budget)
    preemption_mode: str = "recompute"  # or "swap" (to the executor's host tier)
    scheduling_policy: str = "fcfs"  # or "priority" (lower value first, then arrival)
    log_json: bool = False


@dataclass(frozen=True)
class ExecutorServiceConfig:
    """The executor service: the model runtime's config plus its sockets."""

    endpoints: Endpoints
    runtime: RuntimeConfig
    model_path: str
    log_json: bool = False


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer service: which tokenizer and chat template, how long a context may be."""

    endpoints: Endpoints
    model: str = DEFAULT_MODEL_NAME  # the default model's name or a model folder
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    log_json: bool = False
    log_level: str = "info"


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway: where it listens, who may call it, and under which model name."""

    endpoints: Endpoints
    model: str = DEFAULT_MODEL_NAME
    served_model_name: str | None = None  # None: the default model's name or the folder's name
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None  # None: no auth
    admin_timeout_s: float = 0.25  # /metrics asks the scheduler and kvmanager; never wait long
    request_timeout_s: float = 600.0  # a request's whole life, queue included (0: no limit)
    max_queue_len: int = 1024  # requests accepted that have no output yet; past it: 429
    max_concurrent_requests: int = 4096  # open generation requests (streams included); past it: 429
    max_body_bytes: int = 32 * 1024 * 1024  # larger bodies get 413
    # whose admin sockets /health pings; a request needs every one of them
    probed_services: tuple[str, ...] = ("tokenizer", "scheduler", "kvmanager", "executor")
    drain_timeout_s: float = 8.0  # on SIGTERM, open streams get this long to finish
    log_json: bool = False
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model.rstrip("/")).name or DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class RouterConfig:
    """The router: where it listens, which replicas it may send to, and how it weighs them."""

    endpoints: Endpoints  # only its admin socket is its own
    model: str = DEFAULT_MODEL_NAME  # the replicas' model: the router tokenizes prompts as they do
    replicas: tuple[str, ...] = ()  # "URL[,kv_events_port=P][,kv_snapshot_port=Q]"
    replica_dns: str | None = None  # "NAME:PORT" of a headless Service: every address is a replica
    kv_events_port: int = 5555  # where a replica's kvmanager publishes (the tcp layout's ports)
    kv_snapshot_port: int = 5561
    host: str = "0.0.0.0"
    port: int = 8080
    policy: str = "cache_aware"  # or least_loaded, round_robin (baselines)
    block_size: int = 16  # until a replica's snapshot says otherwise
    # the cost of one request already running or waiting on a replica, in prompt tokens to compute
    load_cost_tokens: int = 256
    poll_interval_s: float = 0.5  # how often each replica's /metrics is read (load, liveness)
    dns_interval_s: float = 5.0
    connect_timeout_s: float = 2.0
    max_attempts: int = 3  # replicas a request may be tried on before the client gets an error
    poll_timeout_s: float = 3.0  # a /metrics slower than this is a slow poll
    slow_polls_to_down: int = 3  # in a row: then the replica is down (hung), not just busy
    log_json: bool = False
    log_level: str = "info"


def api_key_from_env() -> str | None:
    """``FOLIO_API_KEY`` when ``--api-key`` is not given (keeps the key out of process lists)."""
    return os.environ.get("FOLIO_API_KEY") or None


def default_run_dir(port: int) -> Path:
    """Where ``folio serve --port PORT`` puts its ``ipc://`` sockets unless told: ``$FOLIO_RUN_DIR``,
    else a folder of its own per port, so that servers on two ports run side by side."""
    explicit = os.environ.get("FOLIO_RUN_DIR")
    return Path(explicit) if explicit else Path(f"/tmp/folio-{port}")

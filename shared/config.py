"""Configuration: frozen dataclasses, and the only place that reads the environment.

Every command-line flag is declared here, once, as metadata on the config field it sets
(``flag(default, help, services)``): its name, help, and which services take it.
``shared/flags.py`` generates every service's parser, the launcher's (``folio serve``) and what
the launcher forwards to each service from these declarations. A field that another config also
has (``max_num_seqs`` in ``RuntimeConfig`` and ``SchedulerConfig``) is declared on one of them and
filled by name in the other.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PORT = 8000


LAUNCHED = ("kvmanager", "executor", "scheduler", "tokenizer", "gateway")  # what ``folio serve`` starts, in order
ALL_SERVICES = (*LAUNCHED, "router")
TRACED = ("executor", "scheduler", "tokenizer", "gateway", "router")  # the services that record spans


@dataclass(frozen=True)
class Flag:
    """A command-line flag, declared once on the config field it sets."""

    help: str
    services: tuple[str, ...]  # whose parsers take it; ``folio serve`` takes it and forwards it to them
    name: str = ""  # default: --the-field-name
    aliases: tuple[str, ...] = ()  # other spellings (e.g. "-tp"); ``folio serve`` forwards the name
    type: Callable | None = None  # default: from the field's annotation
    choices: tuple | None = None
    action: str | None = None  # "store_true"; "append" (repeatable); "extend" (one or more values, repeatable);
    # bool fields default to --x/--no-x
    metavar: str | None = None
    env: Callable[[], object] | None = None  # where the value comes from when the flag is not given
    forward: bool = True  # False: ``folio serve`` hands it over in the environment, not the command line
    launcher_default: bool = False  # ``folio serve`` reads it itself: it has a default there, always forwarded

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def flag(default, help: str, services: tuple[str, ...], **kw):
    """A config field's default, with the flag that sets it."""
    return field(default=default, metadata={"flag": Flag(help=help, services=services, **kw)})


TASKS = ("generate", "embed", "score", "rerank")
POOLING_TASKS = ("embed", "score", "rerank")  # one pooling server whichever is named
TASK_CHOICES = TASKS + tuple(f"generate,{t}" for t in POOLING_TASKS)  # --task: one, or both kinds


def parse_tasks(text: str) -> str:
    """``--task``: one task or a comma-separated list, each one of ``TASKS`` (a ValueError names a bad one)."""
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"--task takes {', '.join(TASKS)} or a comma-separated list of them, not {text!r}")
    return ",".join(tasks)


def log_json_from_env() -> bool:
    return os.environ.get("FOLIO_LOG_JSON", "0") in ("1", "true", "yes")


def batch_invariant_from_env() -> bool:
    """``FOLIO_BATCH_INVARIANT=1`` turns ``--batch-invariant`` on by default."""
    return os.environ.get("FOLIO_BATCH_INVARIANT", "0") in ("1", "true", "yes")


def api_key_from_env() -> str | None:
    """``FOLIO_API_KEY`` when ``--api-key`` is not given (keeps the key out of process lists)."""
    return os.environ.get("FOLIO_API_KEY") or None


def keys_dir_from_env() -> str | None:
    """``FOLIO_KEYS_DIR``: the stack's key folder when ``--keys-dir`` is not given."""
    return os.environ.get("FOLIO_KEYS_DIR") or None


def peer_key_from_env() -> str | None:
    """``FOLIO_PEER_KEY=NAME``: present the key folder's ``peers/NAME`` pair as the client key."""
    return os.environ.get("FOLIO_PEER_KEY") or None


def curve_disabled_from_env() -> bool:
    """``FOLIO_UNSAFE_NO_CURVE=1``: tcp sockets in the clear (``folio bench plane`` only)."""
    return os.environ.get("FOLIO_UNSAFE_NO_CURVE", "0") in ("1", "true", "yes")


def default_keys_dir() -> Path:
    """The key folder ``folio serve`` makes for itself on one host when none is named."""
    return cache_dir() / "keys"


@dataclass(frozen=True)
class PlaneConfig:
    """The internal plane: every service takes the key folder its tcp sockets authenticate with
    (``shared/curve.py``; read once per process, not carried in the service's config)."""

    keys_dir: str | None = flag(None, "the stack's key folder (`folio keys init DIR`; or $FOLIO_KEYS_DIR): every "
                                "tcp socket speaks CURVE with its keys; needed with tcp endpoints", ALL_SERVICES,
                                env=keys_dir_from_env, metavar="DIR")


@dataclass(frozen=True)
class LogConfig:
    """How every service logs (each service's config carries these fields too)."""

    log_json: bool = flag(False, "log JSON lines instead of console text", ALL_SERVICES, action="store_true",
                          env=log_json_from_env)
    log_level: str = flag("info", "debug, info, warning, error", ALL_SERVICES, launcher_default=True)
    # the services that record spans take it (each config below has the field, filled by name)
    otlp_traces_endpoint: str | None = flag(None, "export OpenTelemetry traces (one per request, a span per stage) "
                                            "as OTLP/HTTP protobuf to URL/v1/traces (default: off)", TRACED,
                                            metavar="URL")


def cache_dir() -> Path:
    """Where prepared models live: ``$FOLIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/folio``."""
    explicit = os.environ.get("FOLIO_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "folio"


@dataclass(frozen=True)
class RuntimeConfig:
    """What the executor's model runtime needs to start. ``max_num_seqs`` and
    ``max_num_batched_tokens`` are the scheduler's flags (``SchedulerConfig``), sized for here too."""

    model: str = flag(DEFAULT_MODEL_NAME, "the default model's name, a model folder or a .gguf",
                      ("executor", "tokenizer", "gateway", "router"), launcher_default=True)
    dtype: str = flag("auto", "weights and activations", ("executor",),
                      choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str = flag("auto", "weights: auto keeps the checkpoint's own (the default model: int4); none "
                             "dequantizes to --dtype; int8/int4 round to nearest at load time (CPU: bf16 activations); "
                             "a GPU takes awq/int4 (W4A16 kernel) and fp8 (sm_89+)",
                             ("executor",), choices=("auto", "none", "int8", "int4", "awq", "fp8"))
    cpu_quant_activations: str = flag("int8", "CPU int4/int8 weights: int8 quantizes each row's activations per "
                                      "block of 32 for folio's integer kernels (llama.cpp's way, the fast one); "
                                      "bf16 feeds torch's packed kernels", ("executor",), choices=("int8", "bf16"))
    cpu_activation_passes: int = flag(2, "int8 activations: passes per block of 32: 2 (the value, then its rounding "
                                      "error: about 15 bits) or 1 (llama.cpp's precision: half the integer work, "
                                      "which steps of many rows are bound by)", ("executor",), choices=(1, 2))
    kv_cache_dtype: str = flag("auto", "KV pool elements: auto = --dtype; fp8 = e4m3 with per-layer K/V scales "
                               "calibrated at start (twice the blocks of bf16 for the same bytes)", ("executor",),
                               choices=("auto", "fp8"))
    device: str = flag("auto", "auto, cpu, cuda or cuda:N", ("executor",))
    block_size: int = flag(16, "tokens per KV block (the router: the replicas', until their snapshots say it)",
                           ("executor", "router"))
    num_kv_blocks: int | None = flag(None, "KV pool size in blocks (overrides budgets)", ("executor",))
    num_host_blocks: int = flag(0, "host-memory KV blocks: preemption by swapping copies blocks there, and with "
                                "prefix caching the blocks the device evicts go there (0: none)", ("executor",))
    kv_disk_dir: str | None = flag(None, "a folder for the disk tier of the prefix cache: computed prefix blocks "
                                   "are written there by hash and loaded again (after a restart too, and by other "
                                   "replicas of the same model) when that beats recomputing (default: none)",
                                   ("executor",))
    kv_disk_gb: float = flag(10.0, "the most the disk tier's folder holds, in GB (least recently used files go)",
                             ("executor",))
    kv_role: str = flag("both", "disaggregated serving: prefill computes prompts and first tokens and hands their "
                        "KV to a decode instance (through the router's --prefill/--decode); both: neither, "
                        "the default", ("executor", "gateway"), choices=("prefill", "decode", "both"))
    kv_transfer_port: int = flag(0, "tcp port a prefill instance's executor serves KV transfers on (0: any free "
                                 "port, which the gateway reports with each handle)", ("executor",))
    kv_cache_bytes: int | None = flag(None, "KV pool budget in bytes (CPU; default: a fraction of free memory)",
                                      ("executor",), name="--kv-cache-memory-bytes")
    gpu_memory_utilization: float = flag(0.9, "share of the GPU's memory the weights and the pool may use",
                                         ("executor",))
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    attention_backend: str = flag("auto", "paged attention and the layers' small ops: our CUDA kernels, our CPU "
                                  "kernels (auto: for quantized weights) or the torch reference", ("executor",),
                                  choices=("auto", "torch", "cuda", "cpu"))
    batch_invariant: bool = flag(batch_invariant_from_env(), "a token's logits do not depend on the batch, the "
                                 "chunk, prefill or decode, prefix hits or a recompute (fixed reduction orders; "
                                 "CPU cost: prefill 1.3-1.5x, decode up to 1.16x; default off, or "
                                 "FOLIO_BATCH_INVARIANT=1)", ("executor",))
    enforce_eager: bool = flag(False, "no CUDA graphs: every step launches its kernels from Python (GPU; the CPU is "
                               "always eager)", ("executor",), action="store_true")
    speculative_config: str | None = flag(None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\"|\"suffix\""
                                          "|\"draft_model\", \"num_speculative_tokens\": K, \"model\": DIR, ...} "
                                          "(keys: docs/speculative.md; default: off)", ("executor", "scheduler"),
                                          metavar="JSON")
    # the older spelling, kept as aliases of --speculative-config (runtime/spec_config.py maps them)
    speculative_model: str | None = flag(None, "speculative decoding: a draft model folder sharing the vocabulary, "
                                         "'ngram' (prompt lookup) or 'suffix'; default: off", ("executor", "scheduler"))
    num_speculative_tokens: int = flag(0, "draft tokens proposed per step", ("executor",))
    ngram_prompt_lookup_max: int = flag(4, "longest n-gram the ngram proposer matches", ("executor",))
    ngram_prompt_lookup_min: int = flag(1, "shortest n-gram the ngram proposer matches", ("executor",))
    speculative_disable_by_batch_size: int = flag(0, "propose nothing while this many requests sample in a step "
                                                  "(0: always propose)", ("executor",))
    num_draft_kv_blocks: int | None = None  # the draft model's own pool (default: as many as the target's)
    tensor_parallel_size: int = flag(1, "split the model over this many devices (CPU: processes sharing the cores)",
                                     ("executor",), aliases=("-tp",))
    distributed_executor_backend: str = flag("mp", "how tensor-parallel ranks 1.. start: mp (processes here) or ray "
                                             "(actors; RAY_ADDRESS: an existing cluster, else a local one)",
                                             ("executor",), choices=("mp", "ray"))
    # LoRA adapters (vLLM's flags): the executor holds them; a request picks one by its ``model``
    enable_lora: bool = flag(False, "serve LoRA adapters on the base model (PEFT folders)", ("executor", "gateway"),
                             action="store_true")
    lora_modules: tuple[str, ...] = flag((), "adapters loaded at start, each served under its NAME (needs "
                                         "--enable-lora)", ("executor",), action="extend", metavar="NAME=PATH")
    max_loras: int = flag(4, "adapters on the device at once: the most distinct adapters in one step",
                          ("executor", "scheduler"))
    max_lora_rank: int = flag(16, "largest adapter rank accepted (device slots are sized for it)", ("executor",))
    max_cpu_loras: int | None = flag(None, "adapters kept in host memory, least recently used evicted "
                                     "(default: --max-loras)", ("executor",))
    allow_runtime_lora: bool = flag(False, "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API "
                                    "key)", ("executor", "gateway"), action="store_true")


# The service that binds each endpoint (its host in the tcp layout, and the key its sockets serve
# with: a connecting socket checks that service's public key). In the order of the tcp ports.
ENDPOINT_OWNERS = {
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
    def tcp(base_port: int = 5550, host: str | None = None) -> "Endpoints":
        """Container names as hosts, one port each: the compose stack's layout (``host``: every
        service on that one host instead, e.g. 127.0.0.1)."""
        return Endpoints(**{n: f"tcp://{host or name}:{base_port + i}"
                            for i, (n, name) in enumerate(ENDPOINT_OWNERS.items())})

    def owner(self, address: str) -> str:
        """The service that binds ``address``, one of these endpoints (``KeyError`` for another)."""
        for name, value in vars(self).items():
            if value == address:
                return ENDPOINT_OWNERS[name]
        raise KeyError(f"{address} is none of this stack's endpoints")

    @staticmethod
    def from_env(port: int = DEFAULT_PORT) -> "Endpoints":
        """``FOLIO_ENDPOINTS=tcp`` (compose; ``FOLIO_TCP_HOST``: every service on that host) or
        ``FOLIO_RUN_DIR`` (ipc, default: the run folder of a server on HTTP ``port``); ``FOLIO_KV_EVENTS_ENDPOINT`` / ``FOLIO_KV_SNAPSHOT_ENDPOINT`` move the
        KV event stream and its snapshot socket elsewhere (``folio serve --kv-events-port``: tcp for
        a router)."""
        if os.environ.get("FOLIO_ENDPOINTS", "ipc") == "tcp":
            endpoints = Endpoints.tcp(int(os.environ.get("FOLIO_BASE_PORT", "5550")),
                                      os.environ.get("FOLIO_TCP_HOST") or None)
        else:
            endpoints = Endpoints.ipc(default_run_dir(port))
        moved = {name: os.environ.get(var) for name, var in (("kv_events", "FOLIO_KV_EVENTS_ENDPOINT"),
                                                             ("kv_snapshot", "FOLIO_KV_SNAPSHOT_ENDPOINT"))}
        return replace(endpoints, **{name: value for name, value in moved.items() if value})


# --------------------------------------------------------------------------- back-half services


@dataclass(frozen=True)
class KVManagerConfig:
    """The kvmanager: the block allocator behind the scheduler's per-step request."""

    endpoints: Endpoints
    log_json: bool = False
    enable_prefix_caching: bool = flag(True, "reuse the KV of cached full blocks across requests (default: on)",
                                       ("kvmanager",))


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's batching limits (vLLM's flag names) and where its peers are."""

    endpoints: Endpoints
    max_num_seqs: int = flag(256, "most requests running in one step", ("scheduler", "executor"))
    max_num_batched_tokens: int = flag(2048, "token budget of one step (prefill chunks and decodes together)",
                                       ("scheduler", "executor"))
    max_model_len: int | None = flag(None, "longest prompt + completion (default: the model's context length)",
                                     ("scheduler", "tokenizer"))
    enable_chunked_prefill: bool = flag(True, "split long prompts across steps, mixed with decodes (default: on)",
                                        ("scheduler",))
    long_prefill_token_threshold: int = flag(0, "most tokens one prefill takes per step (0: up to the token budget)",
                                             ("scheduler",))
    max_num_encoder_input_tokens: int = flag(0, "most image placeholder tokens whose vision tower runs in one step "
                                             "(0: the token budget); a chunk stops before an image that would "
                                             "pass it, but a step always takes one image", ("scheduler",))
    max_pooling_tokens_per_step: int = flag(16, "most prompt tokens of pooling requests (embeddings, scores) in "
                                            "one step while a generating request runs (0: no limit but the token "
                                            "budget); alone they take the whole budget", ("scheduler",))
    preemption_mode: str = flag("recompute", "when blocks run out: free and recompute later, or swap to the host "
                                "tier (--num-host-blocks)", ("scheduler",), choices=("recompute", "swap"))
    scheduling_policy: str = flag("fcfs", "queue order: arrival, or the request's priority (lower first) then "
                                  "arrival", ("scheduler",), choices=("fcfs", "priority"))
    async_scheduling: bool = flag(True, "plan step N+1 while the executor runs step N (default: on; beams, forks, "
                                  "grammars, speculative decoding and preemption wait for the step's result)",
                                  ("scheduler",))
    speculative_model: str | None = None  # the executor's flag: with drafts every step waits for the last
    speculative_config: str | None = None  # the executor's flag, the same
    max_loras: int = 4  # the executor's flag: the most distinct adapters admitted into one step
    log_json: bool = False
    otlp_traces_endpoint: str | None = None  # LogConfig's flag: tracing on (``folio.shared.tracing``)


@dataclass(frozen=True)
class ExecutorServiceConfig:
    """The executor service: the model runtime's config plus its sockets."""

    endpoints: Endpoints
    runtime: RuntimeConfig
    model_path: str
    log_json: bool = False
    otlp_traces_endpoint: str | None = None  # tracing on: each step's result carries its start and end


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer service: which tokenizer and chat template, how long a context may be."""

    endpoints: Endpoints
    model: str = DEFAULT_MODEL_NAME  # the default model's name or a model folder
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    log_json: bool = False
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway: where it listens, who may call it, and under which model name."""

    endpoints: Endpoints
    model: str = DEFAULT_MODEL_NAME
    served_model_name: str | None = flag(None, "the model name clients use (default: the model's name or folder "
                                         "name)", ("gateway",))
    host: str = flag("0.0.0.0", "HTTP address to listen on", ("gateway", "router"), launcher_default=True)
    port: int = flag(8000, "HTTP port (the gateway: 8000, the router: 8080)", ("gateway", "router"),
                     launcher_default=True)
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on every request (or $FOLIO_API_KEY; the "
                               "router passes it on to its replicas)", ("gateway", "router"), env=api_key_from_env,
                               forward=False)
    admin_timeout_s: float = 0.25  # /metrics asks the scheduler and kvmanager; never wait long
    request_timeout_s: float = flag(600.0, "seconds a request may take in all, queue included; 0: no limit "
                                    "(default 600)", ("gateway",), name="--request-timeout")
    max_queue_len: int = flag(1024, "requests accepted but without output yet; more get 429 (default 1024)",
                              ("gateway",))
    max_concurrent_requests: int = flag(4096, "open generation requests, streams included; more get 429 "
                                        "(default 4096)", ("gateway",))
    max_body_bytes: int = flag(16 * 1024 * 1024, "larger request bodies get 413, unread past the limit (a declared "
                               "Content-Length over it: unread at all; default 16777216)", ("gateway",),
                               name="--max-request-bytes", aliases=("--max-body-bytes",))
    body_timeout_s: float = 30.0  # a request body not all read by then is a 408: a slow client holds no slot
    # a connection that has not sent a whole request line and headers this long after it opened
    # (or after its last response: an idle keep-alive connection too) is closed; no handler ran
    header_timeout_s: float = 15.0
    max_replays: int = flag(3, "times in a row (without output in between) a request in flight is replayed "
                            "after a scheduler or tokenizer restart before it ends with an error (default 3; 0: "
                            "never replayed)", ("gateway",))
    # whose admin sockets /health pings; a request needs every one of them
    probed_services: tuple[str, ...] = ("tokenizer", "scheduler", "kvmanager", "executor")
    drain_timeout_s: float = flag(8.0, "on SIGTERM, seconds open requests get to finish while new ones on open "
                                  "connections get 503 (default 8)", ("gateway",), name="--drain-timeout")
    reasoning_parser: str = flag("auto", "split the reasoning a model writes in <think>...</think> from its answer "
                                 "(reasoning_content, reasoning items): qwen3, deepseek_r1, none; auto: the model "
                                 "family's (Qwen3 checkpoints: qwen3; others: none)", ("gateway",),
                                 choices=("auto", "none", "qwen3", "deepseek_r1"))
    tool_call_parser: str = flag("auto", "the format tool calls are read from in free text: hermes (Qwen), "
                                 "llama3_json, pythonic (Llama 3.2/4), mistral, qwen3_coder; auto: any of them",
                                 ("gateway",), choices=("auto", "hermes", "llama3_json", "pythonic", "mistral",
                                                        "qwen3_coder"))
    response_store_size: int = flag(1024, "Responses API: responses kept for previous_response_id (oldest go "
                                    "first; default 1024)", ("gateway",))
    response_store_ttl_s: float = flag(3600.0, "Responses API: seconds a stored response may be continued "
                                       "(default 3600)", ("gateway",), name="--response-store-ttl")
    task: str = flag("generate", "what the server answers: generate (completions, chat, responses, messages), "
                     "embed, score or rerank (one pooling server: /v1/embeddings, /v1/rerank, /v1/score), or "
                     "generate,embed (both kinds of route, one engine); default generate", ("gateway",),
                     choices=TASK_CHOICES)
    allowed_media_domains: str = flag("", "hosts (comma-separated; their subdomains too) that chat image_url "
                                      "parts may fetch http(s) images from (default: none, data URLs only)",
                                      ("gateway",))
    max_image_bytes: int = flag(20_000_000, "the largest image file a request may send or have fetched, in bytes "
                                "(default 20000000)", ("gateway",))
    limit_images_per_prompt: int = flag(8, "images one chat request may carry (default 8)", ("gateway",))
    media_fetch_timeout_s: float = flag(10.0, "seconds an http(s) image fetch may take (default 10)", ("gateway",),
                                        name="--media-fetch-timeout")
    max_pooling_inputs: int = flag(2048, "inputs (or documents, or pairs) one embeddings, rerank or score request "
                                   "may carry (default 2048)", ("gateway",))
    rerank_template: str | None = flag(None, "the prompt a yes/no reranker reads, with {query}, {document} and "
                                       "{instruction} (default: Qwen3-Reranker's)", ("gateway",))
    rerank_instruction: str | None = flag(None, "the {instruction} of the rerank template (default: "
                                          "Qwen3-Reranker's web search one)", ("gateway",))
    rerank_yes_token: str = flag("yes", "the token whose probability against --rerank-no-token is the score "
                                 "(default yes)", ("gateway",))
    rerank_no_token: str = flag("no", "the other token of the score (default no)", ("gateway",))
    enable_lora: bool = False  # the executor's flags: ``model`` may name an adapter the executor holds
    allow_runtime_lora: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer
    kv_role: str = "both"  # the executor's flag: a prefill instance answers the kv_transfer extension
    log_json: bool = False
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None

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
    replicas: tuple[str, ...] = flag((), "a replica's HTTP base URL (repeat for more); its kvmanager's ports default "
                                     "to --kv-events-port and --kv-snapshot-port on the same host", ("router",),
                                     name="--replica", action="append",
                                     metavar="URL[,kv_events_port=P][,kv_snapshot_port=Q]")
    prefill: tuple[str, ...] = flag((), "disaggregated serving: a --kv-role prefill instance's HTTP base URL (repeat "
                                    "for more; same suffixes as --replica); needs --decode", ("router",),
                                    name="--prefill", action="append",
                                    metavar="URL[,kv_events_port=P][,kv_snapshot_port=Q]")
    decode: tuple[str, ...] = flag((), "disaggregated serving: a --kv-role decode instance's HTTP base URL (repeat for "
                                   "more); it also serves requests whole when no prefill instance is up", ("router",),
                                   name="--decode", action="append",
                                   metavar="URL[,kv_events_port=P][,kv_snapshot_port=Q]")
    replica_dns: str | None = flag(None, "every address NAME resolves to is a replica on PORT (a Kubernetes "
                                   "headless Service)", ("router",), metavar="NAME:PORT")
    kv_events_port: int = flag(5555, "where replicas publish KV events (default: the tcp layout's, 5555)",
                               ("router",))
    kv_snapshot_port: int = flag(5561, "where replicas answer KV snapshots (default: the tcp layout's, 5561)",
                                 ("router",))
    host: str = "0.0.0.0"
    port: int = 8080
    policy: str = flag("cache_aware", "cache_aware (default), or the baselines least_loaded and round_robin",
                       ("router",), choices=("cache_aware", "least_loaded", "round_robin"))
    block_size: int = 16  # until a replica's snapshot says otherwise
    # the cost of one request already running or waiting on a replica, in prompt tokens to compute
    api_key: str | None = None  # the gateway's flag: the router's own /v1/ routes want it too
    load_cost_tokens: int = flag(256, "what one running or waiting request on a replica weighs, in prompt tokens "
                                 "to compute", ("router",))
    poll_interval_s: float = flag(0.5, "seconds between reads of each replica's /metrics (load and liveness)",
                                  ("router",), name="--poll-interval")
    dns_interval_s: float = flag(5.0, "seconds between lookups of --replica-dns", ("router",), name="--dns-interval")
    connect_timeout_s: float = 2.0
    max_attempts: int = flag(3, "replicas a request is tried on before the client gets a 503", ("router",))
    poll_timeout_s: float = flag(3.0, "a poll slower than this is slow; 3 slow polls in a row mark the replica down",
                                 ("router",), name="--poll-timeout")
    slow_polls_to_down: int = 3  # in a row: then the replica is down (hung), not just busy
    log_json: bool = False
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None


def default_run_dir(port: int) -> Path:
    """Where ``folio serve --port PORT`` puts its ``ipc://`` sockets unless told: ``$FOLIO_RUN_DIR``,
    else a folder of its own per port under ``$TMPDIR`` (default /tmp), so that servers on two ports
    run side by side."""
    explicit = os.environ.get("FOLIO_RUN_DIR")
    return Path(explicit) if explicit else Path(tempfile.gettempdir()) / f"folio-{port}"


def make_run_dir(run_dir: str | Path) -> Path:
    """Make ``run_dir`` if it is missing, 0700 either way: whoever can open an ipc socket can speak
    to its service, so the folder is its user's alone (another user's folder is left as it is)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.chmod(run_dir, 0o700)
    except PermissionError:
        pass
    return run_dir


def ipc_folders(endpoints: Endpoints) -> set[Path]:
    """The folders that ``endpoints``' ``ipc://`` sockets live in (none for a tcp layout)."""
    return {Path(address.removeprefix("ipc://")).parent for address in vars(endpoints).values()
            if address.startswith("ipc://")}

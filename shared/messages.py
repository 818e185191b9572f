"""Every message that crosses a socket, in one module.

Each type is a ``msgspec.Struct`` with a type tag, encoded as msgpack; no pickle ever crosses a
socket, and no tensor either: only token ids, block ids and small per-step metadata. Decoding
validates the shape, so a malformed message raises ``msgspec.ValidationError`` (or
``msgspec.DecodeError``) that the receiving service logs and drops. A request's sampling
parameters are one struct of their own, ``shared/sampling.py``'s ``SamplingParams``, carried as
it was built from the gateway to the executor.

The types made per request per step (deltas, plan entries, allocator ops, logprobs, KV events) are
``gc=False``: out of the cyclic collector's counts and walks (none of them can be part of a
cycle: they hold only values and other such structs, and are frozen). Each one made counted towards
a collection, and at 256 decodes a step made over a thousand of them.

Who talks with what (PUSH/PULL pipeline, then DEALER/ROUTER request/reply):
- gateway -> tokenizer: ``GenerateRequest``, ``AbortRequest``;
- tokenizer -> scheduler: ``EngineRequest``, ``AbortRequest`` (client gone, stop string hit);
- scheduler -> tokenizer: ``TokenBatch`` (new tokens of many requests per step);
- tokenizer -> gateway: ``TextBatch`` (text deltas, finish reasons, usage, errors);
- gateway -> tokenizer -> gateway: ``TokenizeRequest``/``DetokenizeRequest`` -> ``TokenizeReply``
  (``/tokenize``, ``/detokenize``), on the same PUSH/PULL pipeline;
- scheduler -> executor: ``StepPlan``; executor -> scheduler: ``StepResult``;
- any CLI -> a service's admin socket: ``AdminRequest``; reply: ``AdminReply``.
The kvmanager's request/reply types (the scheduler's per-step allocator log, ``KVStepRequest``)
are appended at the end of this module with the kvmanager, followed by the KV events it PUBlishes
(``KVEventBatch`` of ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``, vLLM's shapes) and the
snapshot a router asks for (``KVSnapshotRequest`` -> ``KVSnapshot``) when it starts or sees a gap
in the events.
"""

from __future__ import annotations

import msgspec

from folio.shared.sampling import SamplingParams


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """A structured-output spec the tokenizer checked (``folio/core/structured/grammar.py``); the executor
    compiles it against the vocabulary once per ``key`` (a hash of kind and spec). It rides beside a
    request's ``SamplingParams`` (``EngineRequest.grammar``, ``NewRequestData.grammar``)."""

    key: str
    kind: str  # json_schema, json_object, regex, choice, grammar
    spec: str  # the schema as JSON text, the regex, the choices as a JSON list, the EBNF


class TokenLogprobs(msgspec.Struct, gc=False, frozen=True, array_like=True):
    """Logprob of a chosen token plus the top-n alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


class ImageInput(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """One image of a prompt, as its model's processor made it: its placeholders are prompt
    positions ``[offset, offset + length)``, and the vision tower reads ``data``, the pixel
    values' raw little-endian bytes of ``dtype`` and ``shape`` (never a pickled tensor).
    ``hash``: the sha256 (hex) of the pixel values, which keys the prefix cache's blocks that
    hold its placeholders. ``grid``: the image's (temporal, height, width) patch grid where its
    tower reads patches of any image size (Qwen2.5-VL: ``data`` holds those patches, one row
    each, and the placeholders' M-RoPE positions follow the grid); empty for fixed-size tiles."""

    offset: int
    length: int
    hash: str
    dtype: str  # a numpy dtype name ("float32")
    shape: list[int]
    data: bytes
    grid: list[int] = []
    # its placeholders attend each other both ways (Gemma 3): a step computes all of them or none
    both_ways: bool = False


class NewRequestData(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """A request the executor has not seen (or one resumed after preemption by recompute)."""

    req_id: str
    token_ids: list[int]  # prompt, then any output already generated
    num_prompt_tokens: int
    sampling: SamplingParams  # as the gateway (or folio.LLM) built it
    block_ids: list[int]
    grammar: Grammar | None = None  # structured output: every sampled token keeps the output inside it
    num_computed_tokens: int = 0
    # False for beams: the scheduler picks each beam's next token and sends it (``new_token_ids``)
    append_sampled: bool = True
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # a prefill instance's request (``--kv-role prefill``): the z85 CURVE key of the one decode
    # instance its prompt's KV transfer is served to (None: the first peer of the stack that pulls it)
    kv_export_peer: str | None = None
    images: list[ImageInput] = []  # its prompt's images: the vision tower's input


class RunningRequestData(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """The per-step diff of a request the executor already holds."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # tokens the scheduler appended (a beam's chosen token), not sampled here
    new_token_ids: list[int] = []
    # the whole table, when blocks inside it changed (copy-on-write); then ``new_block_ids`` is empty
    block_ids: list[int] | None = None


class KVLoad(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """A new request whose prompt KV comes from a prefill instance: the handle's blocks go into
    ``block_ids`` (-1: a block this pool's prefix cache holds already, skipped). The request is
    planned from ``num_computed_tokens`` on; should the pull fail, the executor computes it from
    ``fallback_computed_tokens`` (its cached prefix) in the same step instead."""

    req_id: str
    handle: dict
    block_ids: list[int]
    fallback_computed_tokens: int = 0


class StepPlan(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="step_plan"):
    """One iteration's work for the executor.

    ``num_scheduled_tokens[req_id]`` new tokens are computed for each scheduled request, starting
    at its ``num_computed_tokens``. A request samples a token when the step reaches the end of the
    tokens it has. Before the step the executor makes the kvmanager's copies, in this order:
    ``swap_out`` (device block, host block) pairs, ``swap_in`` (host block, device block) pairs,
    then ``block_copies`` (src, dst) copy-on-write pairs inside the device pool. Swap-outs come
    first because the device blocks they vacate may be handed out again in the same step.
    """

    step_id: int
    new_reqs: list[NewRequestData] = []
    running_reqs: list[RunningRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    finished_req_ids: list[str] = []
    block_copies: list[tuple[int, int]] = []
    swap_out: list[tuple[int, int]] = []
    swap_in: list[tuple[int, int]] = []
    # speculative decoding: the draft tokens each request verifies this step; they follow its
    # last token in its chunk (``num_scheduled_tokens`` counts them)
    spec_token_ids: dict[str, list[int]] = {}
    # structured output: grammars to compile now (the scheduler holds back the sampling token of
    # their requests until the result names them ready); with nothing scheduled and
    # ``await_grammars`` set, the executor answers once one of them is ready (or after a short poll)
    grammars: list[Grammar] = []
    await_grammars: bool = False
    # async scheduling: decodes whose input is the token the executor sampled in the step before,
    # which the scheduler had not seen when it planned this one (the executor holds it already)
    num_placeholder_tokens: int = 0
    # disaggregated prefill: KV to pull into new requests' blocks before the step
    kv_loads: list[KVLoad] = []
    # the disk tier (``folio.core.kv.tiers``): before every copy above, write these blocks
    # (0 device / 1 host, block id, block hash) to files; after the swap-ins, read these files
    # (device block id, block hash) into the blocks
    tier_saves: list[tuple[int, int, bytes]] = []
    tier_loads: list[tuple[int, bytes]] = []


class StepResult(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="step_result"):
    """What one step produced: the sampled tokens of the requests that sampled (with speculative
    decoding, the accepted drafts and one more token), and the drafts proposed for their next step."""

    step_id: int
    req_ids: list[str] = []
    # the sampled tokens of ``req_ids``, flat, request after request: ``num_sampled[i]`` of them for
    # ``req_ids[i]``, or one each when ``num_sampled`` is empty (a step without drafts verified);
    # ``sampled_token_ids()`` gives them per request
    token_ids: list[int] = []
    num_sampled: list[int] = []
    spec_token_ids: list[list[int]] = []  # per sampled request: its proposal for the next step
    # whether the executor may propose drafts at the end of the next step (decided now, kept then):
    # when not, the scheduler may plan the step after it ahead of its result (async scheduling)
    drafts_next: bool = True
    logprobs: list[list[TokenLogprobs] | None] = []
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    # pooling requests (``SamplingParams.pooling``) whose last prompt chunk ran: their vector as
    # little-endian float32 bytes. They sample nothing and are not in ``req_ids``
    pooled: dict[str, bytes] = {}
    # set by the executor service: the epoch of the pool that ran the step; a change tells the
    # scheduler the executor restarted and its requests must start over
    epoch: str = ""
    # structured output: keys of the plans' ``grammars`` whose compile ended since the last
    # result, compiled (``grammars_ready``) or not (``grammar_errors``: key -> why)
    grammars_ready: list[str] = []
    grammar_errors: dict[str, str] = {}
    # tracing on: the executor's wall-clock start and end of the step (ns), for the scheduler's spans
    # of its prefill chunks and decodes; empty when tracing is off
    exec_ns: list[int] = []
    # the executor refused the plan (``InvalidPlan``) or the step failed: why. The step produced
    # nothing, and the scheduler ends every request it scheduled with this reason
    error: str = ""

    @staticmethod
    def flat(sampled: list[list[int]]) -> dict:
        """``token_ids`` and ``num_sampled`` for per-request token lists (keyword arguments)."""
        if all(len(t) == 1 for t in sampled):
            return {"token_ids": [t[0] for t in sampled]}
        return {"token_ids": [x for t in sampled for x in t], "num_sampled": [len(t) for t in sampled]}

    def sampled_token_ids(self) -> list[list[int]]:
        """The sampled tokens per request (``req_ids`` order)."""
        if not self.num_sampled:
            return [[t] for t in self.token_ids]
        out, at = [], 0
        for n in self.num_sampled:
            out.append(self.token_ids[at : at + n])
            at += n
        return out


# --------------------------------------------------------------------------- request pipeline


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function call of an assistant message (OpenAI's shape, ``arguments`` a JSON string)."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str
    # content with images: its parts in order, {"type": "image"} or {"type": "text", "text": ...}
    # (the chat template places each image's token); the images ride in ``GenerateRequest.images``
    parts: list[dict[str, str]] = []
    tool_calls: list[ToolCall] = []  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None


class GuidedSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match, before compiling: ``kind`` json_schema (``spec`` the schema as
    JSON text), json_object (``spec`` empty), regex, choice (``spec`` a JSON list of strings) or
    grammar (EBNF/GBNF text). ``param`` names the request field it came from, for a 400."""

    kind: str
    spec: str = ""
    param: str = "response_format"


class TransferHandle(msgspec.Struct, frozen=True, kw_only=True):
    """The handle of a KV transfer (``folio.core.executor.runtime.kv_transfer``): where a prefill
    instance holds a request's prompt KV for a decode instance to pull. It travels prefill gateway
    -> router -> decode gateway (the ``kv_transfer`` extension field) -> scheduler -> executor, as a
    dict in ``GenerateRequest.kv_transfer``."""

    transfer_id: str
    endpoint: str  # the sender's socket, tcp://host:port
    num_blocks: int
    num_tokens: int = 0  # the prompt tokens the blocks hold

    def to_wire(self) -> dict:
        return msgspec.to_builtins(self)

    @classmethod
    def from_wire(cls, d: object) -> "TransferHandle":
        """Validated: a malformed handle is a ValueError naming the problem."""
        try:
            h = msgspec.convert(d, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid kv transfer handle: {exc}") from None
        if not h.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"invalid kv transfer handle: endpoint {h.endpoint!r} is not a ZeroMQ address")
        if h.num_blocks < 0 or h.num_tokens < 0 or not h.transfer_id:
            raise ValueError("invalid kv transfer handle: negative counts or an empty transfer id")
        return h


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    """gateway -> tokenizer: one completion choice to produce (the gateway fans out ``n``).

    Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (chat) is set.
    """

    req_id: str
    sampling: SamplingParams  # stop strings included; it travels on unchanged
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # a text prompt's: the tokenizer's BOS/EOS (a reranker's formatted pair: none)
    echo: bool = False  # also return the prompt text (completions only)
    stream: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None  # passed on to EngineRequest
    # more choices of the same prompt (their req_ids): the scheduler forks them from this one
    # after the prompt is computed, or, with ``sampling.use_beam_search``, they receive the best beams
    fork_req_ids: list[str] = []
    # structured output: the tokenizer checks it (cached by hash) into ``EngineRequest.grammar``
    guided: GuidedSpec | None = None
    tools: list[dict] | None = None  # OpenAI tool definitions, rendered by the chat template
    chat_template_kwargs: dict | None = None  # extra template variables (Qwen3's enable_thinking)
    lora_name: str | None = None  # the LoRA adapter (the request's ``model`` names it); None: the base model
    # tracing on (``folio.shared.tracing``): the W3C traceparent of the gateway's request span
    traceparent: str | None = None
    # a continuation (a replay after a restart, a stream resumed on another replica): output tokens
    # already delivered, computed again but not sampled; they count as output (positions, penalties,
    # max_tokens, the grammar) and their text and logprobs are not sent again
    forced_token_ids: list[int] = []
    # disaggregated prefill: where the prompt's KV is to be pulled from (a ``TransferHandle``
    # as a dict); with ``forced_token_ids`` = the first token the prefill instance sampled. On a
    # prefill instance ``{"export_to": z85 key}``: the decode instance its transfer is served to
    kv_transfer: dict | None = None
    # the prompt's images, in the order the prompt names them: each an encoded image file (PNG,
    # JPEG ...) that the tokenizer decodes and runs through the model's processor
    images: list[bytes] = []


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True, tag="engine_request"):
    """tokenizer -> scheduler: a tokenized request, ready to schedule."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = 0.0
    # keeps tenants' prefix caches apart: blocks are only shared between requests with equal salts
    cache_salt: str | None = None
    # more choices of this prompt: choice i (1-based) gets ``sampling.with_seed_offset(i)`` and
    # shares the prompt's blocks (forked once the prompt is computed); with
    # ``sampling.use_beam_search`` the choices are the best of ``sampling.num_sequences`` beams, best first
    fork_req_ids: list[str] = []
    lora_name: str | None = None  # the LoRA adapter; None: the base model
    traceparent: str | None = None  # tracing on: the gateway's request span, the parent of the later stages'
    # a continuation: output tokens placed as already generated (``GenerateRequest.forced_token_ids``)
    forced_token_ids: list[int] = []
    kv_transfer: dict | None = None  # pull the prompt's KV from there (``GenerateRequest.kv_transfer``)
    grammar: Grammar | None = None  # structured output: the checked spec of ``GenerateRequest.guided``
    images: list[ImageInput] = []  # the prompt's images, as the model's processor made them


class AbortRequest(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Stop a request and free its blocks: client gone, stop string hit, admin abort."""

    req_id: str
    reason: str = "abort"  # "abort" (client gone, admin) or "stop" (a stop string matched)


class TokenDelta(msgspec.Struct, gc=False, frozen=True, kw_only=True, omit_defaults=True):
    """New tokens of one request from one step; ``finish_reason`` set on its last delta."""

    req_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" (EOS / stop token), "length", "abort", "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # with finish_reason "error": why the scheduler refused the request (prompt + max_tokens beyond
    # the model's context or the whole KV pool); the tokenizer passes it on as TextDelta.error
    error: str | None = None
    error_code: int = 400  # 503 while the scheduler drains
    pooled: bytes | None = None  # a pooling request's vector (little-endian float32), on its one delta
    # on a request's first delta: seconds from its arrival to its first step (the queue time)
    queue_time_s: float | None = None


class TokenBatch(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="token_batch"):
    """scheduler -> tokenizer: every request's new tokens of one step, in one message.

    Most of a decode step's deltas are one token of a running request and nothing else (no
    finish, counts or logprobs): those travel flat, ``plain_req_ids[i]`` got ``plain_token_ids[i]``,
    and ``deltas`` holds the rest. A request is in one of the two at most."""

    step_id: int
    deltas: list[TokenDelta] = []
    plain_req_ids: list[str] = []
    plain_token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.deltas) + len(self.plain_req_ids)

    def all_deltas(self) -> list[TokenDelta]:
        """Every delta as a ``TokenDelta`` (the plain ones first)."""
        plain = [TokenDelta(req_id=r, token_ids=[t]) for r, t in zip(self.plain_req_ids, self.plain_token_ids)]
        return plain + self.deltas


class TopLogprob(msgspec.Struct, gc=False, frozen=True, array_like=True):
    token: str
    logprob: float
    token_id: int
    token_bytes: list[int] | None = None  # only when ``token`` is part of a character (shows U+FFFD)


class TextLogprob(msgspec.Struct, gc=False, frozen=True, kw_only=True):
    """A sampled (or prompt) token's logprob with its text, ready for the OpenAI response."""

    token: str
    token_id: int
    logprob: float | None
    top: list[TopLogprob] = []
    text_offset: int = 0
    # the token's raw bytes, only when ``token`` is part of a character (its text shows U+FFFD)
    token_bytes: list[int] | None = None
    rank: int | None = None  # of the token among the whole vocabulary (1: the most likely)


class TextDelta(msgspec.Struct, gc=False, frozen=True, kw_only=True, omit_defaults=True):
    """New text of one request. An ``error`` ends the request before any text was produced."""

    req_id: str
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TextLogprob] | None = None
    prompt_text: str | None = None  # with echo, on the first delta
    prompt_logprobs: list[TextLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: int = 400
    error_param: str | None = None  # the request field the error is about, for the OpenAI error
    queue_time_s: float | None = None  # passed on from the TokenDelta, for /metrics
    pooled: bytes | None = None  # a pooling request's vector (little-endian float32), passed on


class TextBatch(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="text_batch"):
    """tokenizer -> gateway: text deltas of many requests in one message."""

    deltas: list[TextDelta]


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, tag="tokenize"):
    """gateway -> tokenizer (``/tokenize``): the token ids of a prompt or of a chat rendered by
    the chat template (exactly one of ``prompt`` and ``messages``); reply ``TokenizeReply``."""

    req_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    return_token_strs: bool = False
    # the chat's images (encoded image files, in order): the count includes their placeholders, as
    # the model's processor expands them for a generate request
    images: list[bytes] = []


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, tag="detokenize"):
    """gateway -> tokenizer (``/detokenize``): the text of token ids; reply ``TokenizeReply``."""

    req_id: str
    token_ids: list[int]


class TokenizeReply(msgspec.Struct, frozen=True, kw_only=True, tag="tokenize_reply", omit_defaults=True):
    """tokenizer -> gateway: the answer to a ``TokenizeRequest`` (``token_ids``, ``token_strs``
    when asked) or a ``DetokenizeRequest`` (``text``), or why there is none (``error``)."""

    req_id: str
    token_ids: list[int] = []
    token_strs: list[str] | None = None
    text: str | None = None
    max_model_len: int = 0
    error: str | None = None
    error_code: int = 400
    error_param: str | None = None


# --------------------------------------------------------------------------- admin


class AdminRequest(msgspec.Struct, frozen=True, kw_only=True, tag="admin"):
    """A CLI (or the gateway's /metrics) asking a service something through its admin socket."""

    command: str  # "stats", "seq", "blocks", "clear", "requests", "abort", "drain", "ping"
    args: dict[str, str | int | float | bool | None] = {}


class AdminReply(msgspec.Struct, frozen=True, kw_only=True, tag="admin_reply"):
    ok: bool
    data: dict = {}
    error: str | None = None


# --------------------------------------------------------------------------- kvmanager
# executor -> kvmanager: RegisterPool (reply PoolInfo); scheduler -> kvmanager: GetPool (answered
# with PoolInfo once a pool is registered, so the scheduler waits without polling), KVReset
# (reply PoolInfo) at each new sync epoch, and the KVStepRequest log of each step that changed
# the tables (reply KVStepReply, read whenever it arrives). The kvmanager sends KVClearCache to
# the scheduler unasked. All over the kvmanager's ROUTER (DEALER peers).


class RegisterPool(msgspec.Struct, frozen=True, kw_only=True, tag="register_pool"):
    """executor -> kvmanager at start, then again every few seconds (so that a restarted
    kvmanager learns the pool; the same message again changes nothing): the pool it allocated. A
    new ``epoch`` (one per executor start) resets every block table: the old pool's contents are
    gone."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    epoch: str
    max_model_len: int = 0  # the model's context length (0: unknown)
    num_host_blocks: int = 0  # the host tier for swapping (0: none)
    sliding_window: int = 0  # every layer's attention window W (0: some layer attends to all positions)
    kv_disk_dir: str = ""  # the disk tier's folder ("": none) and the pool's layout id in it
    kv_layout_id: str = ""
    kv_disk_bytes: int = 0


class GetPool(msgspec.Struct, frozen=True, kw_only=True, tag="get_pool"):
    """scheduler -> kvmanager: the registered pool; the reply waits until there is one."""


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True, tag="pool_info"):
    num_blocks: int
    block_size: int
    bytes_per_block: int
    epoch: str
    max_model_len: int = 0
    num_free_blocks: int = 0
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True  # the kvmanager's setting: the scheduler's replica follows it
    sliding_window: int = 0  # the model's, when every layer has one: blocks behind it go back (``folio/core/kv``)
    kv_disk_dir: str = ""  # the executor's disk tier ("": none), its layout id and cap
    kv_layout_id: str = ""
    kv_disk_bytes: int = 0


# The step log: the allocator operations of one scheduler step, in the order the scheduler
# applied them to its own replica while it planned the step (``folio/core/kv/steplog.py``). The
# kvmanager applies the same log in the same order, so both hold the same tables and block ids.
# Each op is a short array on the wire: [tag, fields...].


class KVConfirm(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="c"):
    """Every allocation so far counts as computed, except ``discard_req_ids``'s (their step failed):
    the full blocks among them become findable in the prefix cache. ``keep_req_ids``' allocations
    stay unconfirmed: their step is still running (async scheduling plans the next one meanwhile)."""

    discard_req_ids: list[str] = []
    keep_req_ids: list[str] = []


class KVFree(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="f"):
    """Release these tables (finished, aborted, preempted by recompute); unknown ids are fine."""

    req_ids: list[str]


class KVTruncate(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="t"):
    """Keep only the blocks of the first ``num_tokens`` tokens (rejected draft tokens go back)."""

    req_id: str
    num_tokens: int


class KVFork(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="k"):
    """The child gets a copy of the parent's table (ref counts bumped, nothing copied yet);
    ``num_tokens``: the tokens the parent's table holds KV for."""

    parent_req_id: str
    child_req_id: str
    num_tokens: int


class KVSwapOut(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="o"):
    req_id: str


class KVSwapIn(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="i"):
    req_id: str


class KVAllocate(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="a"):
    """Grow the table to hold ``num_tokens`` tokens, writing from ``num_computed`` (a write into
    a shared, partly filled block copies it). ``new_token_ids``: its tokens the allocator has not
    seen, to hash the blocks they fill. A table new here starts with a prefix-cache lookup,
    salted by ``cache_salt``."""

    req_id: str
    num_computed: int
    num_tokens: int
    new_token_ids: list[int] = []
    cache_salt: str | None = None
    # a table new here: the disk tier's blocks, after its device and host hits, that the planner
    # verified and decided to load (``folio.core.kv.tiers``)
    load_hashes: list[bytes] = []


class KVClear(msgspec.Struct, gc=False, frozen=True, array_like=True, tag="x"):
    """Drop the free cached blocks (``folio kv clear``, routed through the log)."""


KVOp = KVConfirm | KVFree | KVTruncate | KVFork | KVSwapOut | KVSwapIn | KVAllocate | KVClear


class KVStepRequest(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="kv_step"):
    """scheduler -> kvmanager, for each step whose log is not empty, sent without waiting for the
    reply. ``generation``: the scheduler's sync epoch (set by ``KVReset``); a log of another
    generation is not applied."""

    step_id: int
    generation: int
    ops: list[KVOp] = []


class KVStepReply(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="kv_step_reply"):
    """The kvmanager's state digest after applying the log (chained over every step since the
    last reset); ``in_sync`` is False when it holds no state of that generation (it restarted, or
    a new executor registered), and then nothing was applied."""

    step_id: int
    generation: int
    digest: bytes = b""
    in_sync: bool = True


class KVReset(msgspec.Struct, frozen=True, kw_only=True, tag="kv_reset"):
    """scheduler -> kvmanager: start a new sync epoch with empty tables (reply ``PoolInfo``, the
    pool both sides build their allocator for). A kvmanager that knows no pool (it restarted)
    adopts the one described here."""

    generation: int
    pool: PoolInfo


class KVClearCache(msgspec.Struct, frozen=True, kw_only=True, tag="kv_clear_cache"):
    """kvmanager -> scheduler (unasked, on its DEALER): ``folio kv clear`` was asked; the
    scheduler puts a ``KVClear`` into its next step log."""


# --------------------------------------------------------------------------- KV events
# The kvmanager PUBlishes on ``Endpoints.kv_events`` one multipart message per step that changed
# the prefix cache: [topic ``KV_EVENTS_TOPIC``, sequence number (8 bytes big-endian), a msgpack
# ``KVEventBatch``] -- vLLM's ZmqEventPublisher framing, so that a subscriber notices gaps. Block
# hashes are 16-byte blake2b digests (``bytes``).

KV_EVENTS_TOPIC = b"kv-events"


class BlockStored(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="block_stored"):
    """Full blocks entered the prefix cache, as one chain: ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (None: the sequence's first block); ``token_ids`` are theirs, in order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = "GPU"


class BlockRemoved(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="block_removed"):
    """Blocks left the prefix cache (evicted for reuse, or dropped by ``folio kv clear``)."""

    block_hashes: list[bytes]
    medium: str = "GPU"


class AllBlocksCleared(msgspec.Struct, frozen=True, kw_only=True, tag="all_blocks_cleared"):
    """Everything is gone: a new executor epoch (the pool's contents died with the old one)."""


class KVEventBatch(msgspec.Struct, gc=False, frozen=True, kw_only=True, tag="kv_event_batch"):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVSnapshotRequest(msgspec.Struct, frozen=True, kw_only=True, tag="kv_snapshot_request"):
    """router -> kvmanager (its ``kv_snapshot`` ROUTER): what does the prefix cache hold now?"""


class KVSnapshot(msgspec.Struct, frozen=True, kw_only=True, tag="kv_snapshot"):
    """Every block hash the device tier's prefix cache holds, as of just before the event batch
    numbered ``next_event_seq``: a subscriber replaces its view with this and then applies the
    batches numbered ``next_event_seq`` and later. ``epoch``: the registered pool's ("" if none)."""

    next_event_seq: int
    block_size: int
    block_hashes: list[bytes]
    epoch: str = ""


# --------------------------------------------------------------------------- executor's worker group


class WorkerStep(msgspec.Struct, frozen=True, kw_only=True, tag="worker_step"):
    """Rank 0 of a tensor-parallel executor -> every other rank, one broadcast per step (inside
    the worker group's process group, never on a socket): the plan, and the tokens rank 0
    appended in the step before (the other ranks do not sample). ``command``: "step", "stats"
    (each rank reports its device, memory and step times) or "stop"."""

    command: str = "step"
    plan: StepPlan | None = None
    appended: list[tuple[str, list[int]]] = []

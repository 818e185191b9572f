"""One request as the scheduler sees it: its tokens, how many are computed, how many blocks it
holds, and where it is in its life (``Status``).

Its block table lives in the scheduler's allocator replica (``folio.core.kv``), under ``req_id``; the
request remembers only how much of it the executor was sent. What a client asked for is one
request, or several under their own ids: the choices of ``n`` > 1 (forked from the first once its
prompt is computed) and the live beams of a beam search (``group``; ``forks.py``). A continuation
(``EngineRequest.forced_token_ids``) starts with those tokens as its output, like a request
preempted by recompute: only the tokens after them are sampled and sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from folio.core.kv.block_hash import kv_salt
from folio.shared.messages import EngineRequest, Grammar, ImageInput
from folio.shared.sampling import SamplingParams


class Status(str, Enum):
    """Where a request is: in one of the scheduler's three queues, waiting to be forked from its
    parent (a choice of ``n`` or a new beam, in no queue), or finished (its blocks going back)."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FORKING = "forking"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # as the client's request built it (a choice's: with its seed offset)
    # the most output tokens: ``sampling.max_tokens``, or what the context leaves when that is None
    max_tokens: int
    grammar: Grammar | None = None  # structured output
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    on_executor: bool = False  # the executor holds its state (it was sent as NewRequestData)
    admitted: bool = False  # admitted at least once (prompt tokens counted)
    prompt_logprobs_sent: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    images: list[ImageInput] = field(default_factory=list)  # its prompt's images (the executor's tower runs them)
    num_kv_token_ids: int = 0  # of its tokens, those the allocator was told (to hash full blocks)
    num_cached_tokens: int = 0  # prompt tokens its last admission found in the prefix cache
    # its place in the queues: (priority, arrival order, rank among the sequences of one request)
    key: tuple[int, int, int] = (0, 0, 0)
    status: Status = Status.WAITING
    # n > 1: the other choices, forked from this one once all but its last prompt token are computed
    pending_forks: list["Request"] = field(default_factory=list)
    fork_parent: "Request | None" = None  # set until it is forked from its parent
    num_sent_blocks: int = 0  # of its table, the blocks the executor was sent
    # the computed tokens the executor counts for it after the last step it was sent (-1: unknown);
    # a plan names a running request only when this, its blocks or its tokens need telling
    executor_computed: int = -1
    table_changed: bool = False  # blocks inside its table changed (copy-on-write, truncation): send it whole
    append_sampled: bool = True  # False for beams: the group picks their tokens
    # disaggregated prefill: its prompt's KV comes from this handle (``KVLoad``), once: cleared when
    # the plan takes it, so that a readmission recomputes
    kv_transfer: dict | None = None
    kv_export_peer: str | None = None  # a prefill instance's: the decode key its transfer is served to
    unsent_token_ids: list[int] = field(default_factory=list)  # tokens appended here, for the executor
    group: object = None  # the BeamGroup of a beam
    first_scheduled_time: float | None = None
    queue_time_sent: bool = False
    # its prompt and cached token counts went out in a delta since it was last admitted (they
    # change when a readmission finds a different prefix in the cache)
    counts_sent: bool = False
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for its next step
    grammar_ready: bool = False  # the executor reported its grammar compiled (``structured/scheduling.py``)
    # tokens it samples in steps sent but not answered yet (async scheduling): the next step may
    # decode them as placeholders, which the executor fills in with what it sampled
    num_pending: int = 0

    @staticmethod
    def from_message(msg: EngineRequest, max_tokens: int, req_id: str | None = None,
                     sampling: SamplingParams | None = None) -> "Request":
        """``max_tokens``: the output tokens it may have (admission resolved a None)."""
        sampling = sampling or msg.sampling
        return Request(
            req_id=req_id or msg.req_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            grammar=msg.grammar,
            eos_token_id=msg.eos_token_id,
            arrival_time=msg.arrival_time,
            stop_token_ids=frozenset(sampling.stop_token_ids),
            cache_salt=msg.cache_salt,
            lora_name=msg.lora_name,
            images=list(msg.images),
            # a continuation's forced tokens are output already generated: it goes on after them
            # as a request preempted by recompute would (positions, penalties, grammar, max_tokens)
            output_token_ids=list(msg.forced_token_ids),
            prompt_logprobs_sent=bool(msg.forced_token_ids),
            kv_transfer=None if _export_to(msg.kv_transfer) else msg.kv_transfer,
            kv_export_peer=_export_to(msg.kv_transfer),
        )

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def kv_salt(self) -> str | None:
        """The salt its blocks are hashed with: its cache salt, its adapter and its images'
        placeholders and content hashes (``block_hash.kv_salt``)."""
        return kv_salt(self.cache_salt, self.lora_name, [(im.offset, im.length, im.hash) for im in self.images])

    @property
    def num_seqs(self) -> int:
        """Sequences it stands for against ``max_num_seqs``: with its choices still to fork."""
        return 1 + len(self.pending_forks)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without joining the prompt and the output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def stop_reason(self, token_id: int) -> str | None:
        """Why the request ends after ``token_id`` was appended to its output, if it does.
        EOS and stop token ids say "stop" (EOS only without ``ignore_eos``); then ``max_tokens``."""
        if token_id in self.stop_token_ids:
            return "stop"
        if token_id == self.eos_token_id and not self.sampling.ignore_eos:
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens:
            return "length"
        return None

    def take_queue_time(self) -> float | None:
        """Its time in the queue before its first step, once (None after, or when unknown)."""
        if self.queue_time_sent or self.first_scheduled_time is None or not self.arrival_time:
            return None
        self.queue_time_sent = True
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: drop every block and the executor's state, keep the tokens."""
        self.num_computed_tokens = 0
        self.on_executor = False
        self.num_kv_token_ids = 0  # the allocator forgets the table, and its tokens with it
        self.fork_parent = None  # it starts over alone
        self.num_sent_blocks = 0
        self.executor_computed = -1
        self.table_changed = False
        self.unsent_token_ids = []
        self.spec_token_ids = []
        self.num_pending = 0


def _export_to(kv_transfer: dict | None) -> str | None:
    """A prefill instance's ``{"export_to": key}``: the key (None for a handle to pull, or none)."""
    peer = kv_transfer.get("export_to") if isinstance(kv_transfer, dict) else None
    return peer if isinstance(peer, str) and peer else None

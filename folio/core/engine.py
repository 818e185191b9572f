"""The engine in one process: the services' step without sockets.

``EngineCore`` is the scheduler's policy with its allocator replica (the prefix cache included)
and the executor's ``ModelRunner``, stepped by the scheduler service's own step loop
(``scheduler/step_loop.py``), here over the runner itself (``LocalExecutor``). In one process the
replica is the only allocator: the kvmanager, the owner of record that the services keep in step
with it, is not needed (``ReplicaOnly``). ``LLMEngine`` adds the tokenizer service's side: prompts
and chats are encoded by the same ``TextTokenizer``, and token deltas become text deltas
(incremental detokenization, stop strings, logprob text) in the same ``OutputProcessor``.

Used by ``folio.LLM`` (the offline API), by the benchmarks' in-process figures (``generate``) and
by the tests' ``LocalEngine``, which checks every step against an allocator of record.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Coroutine
from typing import TypeVar

from folio.core.executor.runtime.runner import ModelRunner
from folio.core.kv.window import all_layers_window
from folio.core.scheduler.policy import Scheduler
from folio.core.scheduler.state import StepOutput
from folio.core.scheduler.step_loop import StepLoop
from folio.core.scheduler.stats import scheduler_stats
from folio.core.tokenizer.output_processor import OutputProcessor, TokenTexts
from folio.core.tokenizer.text import TextTokenizer
from folio.shared.messages import (
    EngineRequest,
    GenerateRequest,
    Grammar,
    PoolInfo,
    StepPlan,
    StepResult,
    TextDelta,
    TokenBatch,
    TokenDelta,
)
from folio.shared.sampling import SamplingParams

T = TypeVar("T")


class LocalExecutor:
    """The step loop's executor in process: the model runner, run on each plan in the order sent,
    when its result is asked for (so a step planned ahead is planned before the last one runs, as
    the service plans it while the executor runs; in one thread that overlaps nothing, but it
    takes the same path)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.plans: deque[StepPlan] = deque()  # sent, not run yet
        self.execute_seconds_total = 0.0

    async def send_plan(self, plan: StepPlan) -> None:
        self.plans.append(plan)

    async def receive_result(self, step_id: int) -> StepResult:
        plan = self.plans.popleft()
        assert plan.step_id == step_id, (plan.step_id, step_id)
        t0 = time.perf_counter()
        result = self.runner.execute(plan)
        self.execute_seconds_total += time.perf_counter() - t0
        return result


class ReplicaOnly:
    """The step loop's allocator of record in process: none, the replica is the only allocator."""

    out_of_sync = None

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def send_log(self, out: StepOutput) -> None:
        pass

    async def new_epoch(self, reason: str) -> None:
        self.scheduler.new_epoch(self.scheduler.pool)


def run_inline(step: Coroutine[None, None, T]) -> T:
    """Run a coroutine that never waits (every await in process) to its end, in this thread."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise RuntimeError("an in-process step waited for something: it has no event loop to wait in")


class EngineCore:
    """Scheduler + allocator replica + model runner, stepped in the caller's thread by the step loop."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, async_scheduling: bool = False,
                 **scheduler_options):
        """``scheduler_options``: ``Scheduler``'s keyword arguments (chunked prefill, preemption
        mode, scheduling policy, long-prefill threshold, ``max_loras``: by default the runner's
        adapter slots)."""
        pool = runner.pool
        self.runner = runner
        lora = getattr(runner, "lora", None)
        if lora is not None:
            scheduler_options["max_loras"] = min(scheduler_options.get("max_loras") or lora.max_loras, lora.max_loras)
        else:
            scheduler_options.pop("max_loras", None)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len, **scheduler_options)
        self.scheduler.set_pool(PoolInfo(
            num_blocks=pool.num_blocks, block_size=pool.block_size,
            bytes_per_block=runner.pool_shape.bytes_per_block, epoch="local",
            max_model_len=runner.spec.max_position_embeddings, num_free_blocks=pool.num_blocks,
            num_host_blocks=pool.num_host_blocks, enable_prefix_caching=enable_prefix_caching,
            sliding_window=all_layers_window(getattr(runner.spec, "layer_windows", ()))))
        self.scheduler.speculative = runner.proposer is not None
        self.executor = LocalExecutor(runner)
        self.steps = StepLoop(self.scheduler, self.executor, ReplicaOnly(self.scheduler),
                              async_scheduling=async_scheduling, on_plan=self.on_plan)

    @property
    def max_model_len(self) -> int | None:
        return self.scheduler.max_model_len

    def add_request(self, msg: EngineRequest) -> list[TokenDelta]:
        """Queue a request with its choices; a refused one comes back as "error" deltas at once
        (so does one naming a LoRA adapter the runner does not hold)."""
        if msg.lora_name is not None and msg.lora_name not in self.runner.lora_names():
            error = (f"The model `{msg.lora_name}` does not exist." if getattr(self.runner, "lora", None) is not None
                     else f"LoRA adapter {msg.lora_name!r} asked but LoRA is not enabled (enable_lora)")
            return [TokenDelta(req_id=req_id, token_ids=[], finish_reason="error", error=error, error_code=404,
                               num_prompt_tokens=len(msg.prompt_token_ids))
                    for req_id in (msg.req_id, *msg.fork_req_ids)]
        return self.scheduler.add_request(msg)

    def abort(self, req_id: str) -> bool:
        return self.scheduler.abort(req_id)

    def has_work(self) -> bool:
        return self.steps.has_work()

    def step(self) -> TokenBatch | None:
        """One iteration: its deltas (``TokenBatch``); None when there was nothing to schedule."""
        return run_inline(self.steps.step())

    def on_plan(self, out: StepOutput, plan: StepPlan) -> None:
        """Called with each step's decision and plan before it runs (tests check them here)."""

    def stats(self) -> dict:
        """The scheduler's statistics (``folio scheduler stats`` shows the same), with the prefix
        cache's hit rate over every admitted prompt token."""
        stats = scheduler_stats(self.scheduler)
        stats["prefix_cache_hit_rate"] = stats["num_cached_tokens_total"] / max(1, stats["num_prompt_tokens_total"])
        stats["execute_seconds_total"] = self.executor.execute_seconds_total
        return stats


class LLMEngine:
    """``EngineCore`` behind the tokenizer service's text handling: ``GenerateRequest`` in,
    ``TextDelta`` out, exactly as the served pipeline produces them."""

    def __init__(self, core: EngineCore, tokenizer: TextTokenizer):
        self.core = core
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer.decode, TokenTexts(tokenizer.decode_with_specials,
                                                                    tokenizer.raw_bytes))
        self.next_step_id = 0

    def add_request(self, req: GenerateRequest) -> tuple[list[int], str | None, list[TextDelta]]:
        """Encode and queue ``req`` (its choices included): (prompt token ids, prompt text, the
        "error" deltas of a request the scheduler refused, such as one beyond the whole KV pool).
        Raises ``RequestError`` when it cannot run (empty, beyond the context, token ids outside
        the vocabulary)."""
        prompt_token_ids, prompt_text, images = self.tokenizer.prepare_prompt(req)
        self.outputs.add_choices(req, prompt_token_ids, self.tokenizer.eos_token_id, prompt_text)
        refusals = self.core.add_request(EngineRequest(
            req_id=req.req_id, prompt_token_ids=prompt_token_ids, sampling=self.tokenizer.engine_sampling(req.sampling),
            eos_token_id=self.tokenizer.eos_token_id, priority=req.priority, arrival_time=req.arrival_time,
            cache_salt=req.cache_salt, fork_req_ids=req.fork_req_ids,
            lora_name=req.lora_name, images=images))
        return prompt_token_ids, prompt_text, self._texts(TokenBatch(step_id=self.next_step_id, deltas=refusals))

    def abort(self, req_id: str) -> None:
        self.outputs.remove(req_id)
        self.core.abort(req_id)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[TextDelta] | None:
        batch = self.core.step()
        return None if batch is None else self._texts(batch)

    def _texts(self, batch: TokenBatch) -> list[TextDelta]:
        if not batch:
            return []
        texts, stops, _unknown = self.outputs.process(batch)
        self.next_step_id += 1
        for stop in stops:  # a stop string matched: the scheduler frees it, as the service's abort does
            self.core.abort(stop.req_id)
        return texts


def generate(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             eos_token_id: int | None = None, grammar: Grammar | None = None, **engine_options) -> list[list[int]]:
    """Token ids in, each request's generated token ids out, through the real scheduler (token
    budget, preemption, prefix caching): the in-process path of the benchmarks and of
    calibration. ``grammar``: every request's structured output (checked already).
    ``engine_options``: ``EngineCore``'s keyword arguments."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    core = EngineCore(runner, **engine_options)
    outputs: dict[str, list[int]] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        req_id = f"req-{i}"
        outputs[req_id] = []
        refusals = core.add_request(EngineRequest(req_id=req_id, prompt_token_ids=list(prompt), sampling=sp,
                                                  eos_token_id=eos_token_id, grammar=grammar))
        if refusals:
            raise ValueError(f"prompt {i}: {refusals[0].error}")
    while core.has_work():
        batch = core.step()
        if batch is None:
            break
        for req_id, token_id in zip(batch.plain_req_ids, batch.plain_token_ids):
            outputs[req_id].append(token_id)
        for d in batch.deltas:
            if d.finish_reason == "error":
                raise RuntimeError(f"{d.req_id}: {d.error}")
            outputs[d.req_id].extend(d.token_ids)
    return list(outputs.values())


"""A toy driver of the model runner, the oracle of the runner's own tests: it has no policy to
get wrong. (The real engine in one process is ``folio.core.engine``.)

A deliberately simple driver: blocks come from a free list in order, every request runs until it
has ``max_tokens`` new tokens (or hits EOS unless ``ignore_eos``), prompts are fed in chunks of at
most ``chunk_size`` tokens, and all requests run together in one varlen batch every step. The real
policy (token budget, preemption, prefix caching) lives in the scheduler and kvmanager services.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.core.executor.runtime.runner import ModelRunner
from folio.shared.messages import NewRequestData, RunningRequestData, StepPlan
from folio.shared.sampling import SamplingParams


@dataclass
class _Seq:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    started: bool = False
    done: bool = False


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    chunk_size: int | None = None,
    eos_token_id: int | None = None,
    block_order: list[int] | None = None,
    images: list[list] | None = None,
) -> list[list[int]]:
    """Run every prompt to completion together; returns each request's generated token ids.

    ``block_order`` (a permutation of block ids) lets tests hand out non-contiguous blocks;
    ``images``: each prompt's ``ImageInput``s.
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    free = list(block_order if block_order is not None else range(runner.pool.num_blocks))
    free.reverse()
    bs = runner.pool.block_size
    seqs = [_Seq(f"req-{i}", list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    step_id = 0
    finished: list[str] = []
    while not all(s.done for s in seqs):
        new_reqs, running, scheduled = [], [], {}
        for s in seqs:
            if s.done:
                continue
            tokens = s.prompt + s.output
            n = len(tokens) - s.num_computed
            if chunk_size is not None:
                n = min(n, chunk_size)
            need = (s.num_computed + n + bs - 1) // bs - len(s.blocks)
            if need > len(free):
                raise RuntimeError("the toy driver ran out of KV blocks")
            new_blocks = [free.pop() for _ in range(need)]
            s.blocks.extend(new_blocks)
            if not s.started:
                new_reqs.append(
                    NewRequestData(
                        req_id=s.req_id,
                        token_ids=tokens,
                        num_prompt_tokens=len(s.prompt),
                        sampling=s.params,
                        block_ids=list(s.blocks),
                        num_computed_tokens=s.num_computed,
                        images=list(images[seqs.index(s)]) if images else [],
                    )
                )
                s.started = True
            else:
                running.append(RunningRequestData(req_id=s.req_id, new_block_ids=new_blocks, num_computed_tokens=s.num_computed))
            scheduled[s.req_id] = n
            s.num_computed += n
        result = runner.execute(
            StepPlan(step_id=step_id, new_reqs=new_reqs, running_reqs=running, num_scheduled_tokens=scheduled,
                     finished_req_ids=finished)
        )
        finished = []
        by_id = {s.req_id: s for s in seqs}
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids()):
            s = by_id[req_id]
            s.output.extend(tokens)
            hit_eos = eos_token_id is not None and tokens[-1] == eos_token_id and not s.params.ignore_eos
            if len(s.output) >= s.params.max_tokens or hit_eos:
                s.done = True
                finished.append(req_id)
                free.extend(reversed(s.blocks))
        step_id += 1
    runner.execute(StepPlan(step_id=step_id, finished_req_ids=finished))
    return [s.output for s in seqs]

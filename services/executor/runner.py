"""The model runtime: weights, the KV pool, per-request state, and one ``execute`` per step.

The executor service wraps this behind its socket. The scheduler sends per-step diffs (a
``StepPlan``: new requests in full, running ones as new block ids and counts); the runner keeps
what it needs of each request between steps (its tokens, block table, sampling params and seeded
generator), flattens the step into one varlen batch, runs the model and samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.executor.attention import AttentionMetadata, TorchAttentionBackend
from services.executor.kv_pool import KVPool, PoolShape, blocks_for_budget, cpu_kv_budget_bytes, gpu_num_blocks
from services.executor.loader import load_model, resolve_dtype
from services.executor.model import cpu_linear_packing_available, pack_linears_for_cpu
from services.executor.rejection import verify
from services.executor.sampler import SamplingRow, make_generator, sample, token_logprobs
from services.executor.spec_decode import Proposal, make_proposer
from services.executor.structured import GrammarStore, advance
from shared.config import RuntimeConfig
from shared.messages import NewRequestData, SamplingParams, StepPlan, StepResult, TokenLogprobs


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    append_sampled: bool = True  # False for beams: the scheduler sends their tokens
    proposal: Proposal | None = None  # the drafts proposed after its last step, with their q
    matcher: object | None = None  # structured output: its grammar's state after its tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device, model_dtype: torch.dtype):
    """``auto`` picks the CUDA kernels on a GPU when CuPy is importable, else the torch backend."""
    if name not in ("auto", "torch", "cuda"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or cuda")
    if name == "torch" or device.type != "cuda":
        if name == "cuda":
            raise ValueError("the cuda attention backend needs a CUDA device")
        return TorchAttentionBackend()
    try:
        from services.executor.cuda_backend import CudaAttentionBackend
    except ImportError as exc:
        if name == "cuda":
            raise ValueError(f"the cuda attention backend is unavailable: {exc}") from exc
        return TorchAttentionBackend()
    return CudaAttentionBackend(model_dtype)


class ModelRunner:
    def __init__(self, config: RuntimeConfig, model_path: str):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = load_model(model_path, self.dtype, self.device)
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_linear_packing_available():
            pack_linears_for_cpu(self.model)
        self.spec = self.model.spec
        self.backend = make_backend(config.attention_backend, self.device, self.dtype)
        self.pool_shape = PoolShape(
            num_layers=self.spec.num_layers,
            block_size=config.block_size,
            num_kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_dim,
            dtype=self.dtype,
        )
        self.pool = KVPool(self.pool_shape, self._decide_num_blocks(), self.device, config.num_host_blocks)
        self.requests: dict[str, RequestState] = {}
        self.proposer = make_proposer(config, self.spec, self.device, self.dtype, self.backend, self.pool.num_blocks)
        self.grammars = GrammarStore(model_path, self.spec.vocab_size)

    # ------------------------------------------------------------------ pool sizing
    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cpu":
            budget = self.config.kv_cache_bytes or cpu_kv_budget_bytes()
            return blocks_for_budget(budget, self.pool_shape)
        peak = self._profile_gpu_peak()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return gpu_num_blocks(total, self.config.gpu_memory_utilization, peak, self.pool_shape)

    def _profile_gpu_peak(self) -> int:
        """Peak memory (weights + activations, no KV) of a forward pass at the largest batch."""
        num_tokens = self.config.max_num_batched_tokens
        num_seqs = max(1, min(self.config.max_num_seqs, num_tokens))
        bs = self.config.block_size
        lens = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        blocks_per_seq = [(n + bs - 1) // bs for n in lens]
        scratch = KVPool(self.pool_shape, sum(blocks_per_seq), self.device)
        tables, start = [], 0
        for nb in blocks_per_seq:
            tables.append(list(range(start, start + nb)))
            start += nb
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata.build(lens, lens, tables, None, bs, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, meta.positions, scratch.kv_caches, meta, self.backend)
            self.model.compute_logits(hidden[-num_seqs:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.num_bytes
        del scratch
        torch.cuda.empty_cache()
        return peak

    # ------------------------------------------------------------------ request state
    def _add_request(self, new: NewRequestData) -> None:
        self.requests[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling=new.sampling,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=make_generator(new.sampling.seed, self.device),
            append_sampled=new.append_sampled,
        )
        if new.sampling.grammar is not None:  # compiled meanwhile; its matcher is made when it samples
            self.grammars.prepare(new.sampling.grammar)

    def _update_states(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.proposer is not None:
                self.proposer.drop(req_id)
        for new in plan.new_reqs:
            self._add_request(new)
        for running in plan.running_reqs:
            state = self.requests.get(running.req_id)
            if state is None:
                raise KeyError(f"step {plan.step_id} names unknown request {running.req_id!r}")
            if running.block_ids is not None:
                state.block_ids = list(running.block_ids)  # copy-on-write changed blocks inside it
            state.block_ids.extend(running.new_block_ids)
            state.token_ids.extend(running.new_token_ids)
            state.num_computed_tokens = running.num_computed_tokens

    def _copy_blocks(self, plan: StepPlan) -> None:
        """The kvmanager's copies, before the step reads the pool: swap-outs first (the blocks
        they vacate may be written by swap-ins, copies or this step), then swap-ins, then
        copy-on-write."""
        if (plan.swap_out or plan.swap_in) and not self.pool.host_caches:
            raise ValueError(f"step {plan.step_id} swaps blocks but this executor has no host tier")
        if plan.swap_out:
            self.backend.swap_out(self.pool.kv_caches, self.pool.host_caches, plan.swap_out)
        if plan.swap_in:
            self.backend.swap_in(self.pool.host_caches, self.pool.kv_caches, plan.swap_in)
        if plan.block_copies:
            self.backend.copy_blocks(self.pool.kv_caches, plan.block_copies)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._update_states(plan)
        self._copy_blocks(plan)
        states = [self.requests[req_id] for req_id in plan.num_scheduled_tokens]
        if not states:
            return StepResult(step_id=plan.step_id)
        counts = [plan.num_scheduled_tokens[s.req_id] for s in states]
        bs = self.pool.block_size

        input_ids: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []  # flattened index of each sampling sequence's last token (and drafts)
        samplers: list[RequestState] = []
        drafts: list[list[int]] = []  # per sampler: the drafts it verifies (empty: plain sampling)
        prompt_lp: list[tuple[RequestState, int, int]] = []  # (state, first row, num rows)
        for state, n in zip(states, counts):
            spec = plan.spec_token_ids.get(state.req_id, [])
            start = state.num_computed_tokens
            end = start + n - len(spec)  # the real tokens it computes; its drafts follow them
            if end > len(state.token_ids) or (spec and end != len(state.token_ids)):
                raise ValueError(f"{state.req_id}: {n} tokens scheduled but only {len(state.token_ids) - start} to compute")
            if (start + n + bs - 1) // bs > len(state.block_ids):
                raise ValueError(f"{state.req_id}: {start + n} tokens need more than its {len(state.block_ids)} blocks")
            row0 = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            input_ids.extend(spec)
            seq_lens.append(start + n)
            if state.sampling.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
                num = min(end, state.num_prompt_tokens - 1) - start
                prompt_lp.append((state, row0, num))
            if end == len(state.token_ids):
                sample_rows.extend(range(len(input_ids) - len(spec) - 1, len(input_ids)))
                samplers.append(state)
                drafts.append(spec)

        meta = AttentionMetadata.build(counts, seq_lens, [s.block_ids for s in states], None, bs, self.device)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            meta.positions,
            self.pool.kv_caches,
            meta,
            self.backend,
        )
        for state, n in zip(states, counts):
            state.num_computed_tokens += n
        result_prompt_lp = self._prompt_logprobs(hidden, prompt_lp)

        if not samplers:
            return StepResult(step_id=plan.step_id, prompt_logprobs=result_prompt_lp)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        for state in samplers:  # a fresh matcher replays what the request has generated
            if state.sampling.grammar is not None and state.matcher is None:
                state.matcher = self.grammars.matcher(state.sampling.grammar, state.output_token_ids)
        tokens, logprobs = self._sample(logits, samplers, drafts)
        self._advance_grammars(samplers, tokens)
        for state, new in zip(samplers, tokens):
            if state.append_sampled:
                if state.proposal is not None:  # the draft's cache keeps the accepted drafts only
                    self.proposer.rollback(state.req_id, len(state.token_ids) + len(new) - 1)
                state.token_ids.extend(new)
        return StepResult(
            step_id=plan.step_id,
            req_ids=[s.req_id for s in samplers],
            sampled_token_ids=tokens,
            logprobs=logprobs,
            prompt_logprobs=result_prompt_lp,
            spec_token_ids=self._propose(samplers),
        )

    def _sample(self, logits: torch.Tensor, samplers: list[RequestState], drafts: list[list[int]]):
        """Plain sampling for the rows without drafts; verification (rejection sampling) for the
        others. ``logits`` holds one row per plain sampler and ``len(drafts) + 1`` per verifier."""
        tokens: list[list[int]] = [[] for _ in samplers]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(samplers)
        offsets, row = [], 0
        for spec in drafts:
            offsets.append(row)
            row += len(spec) + 1
        plain = [i for i, spec in enumerate(drafts) if not spec]
        if plain:
            rows = [SamplingRow(samplers[i].sampling, samplers[i].generator,
                                samplers[i].token_ids[: samplers[i].num_prompt_tokens], samplers[i].output_token_ids,
                                samplers[i].matcher)
                    for i in plain]
            out = sample(logits[torch.tensor([offsets[i] for i in plain], device=logits.device)], rows)
            for i, token_id, lp in zip(plain, out.token_ids, out.logprobs):
                tokens[i] = [token_id]
                logprobs[i] = [lp] if lp is not None else None
        spec_idx = [i for i, spec in enumerate(drafts) if spec]
        if spec_idx:
            target = torch.cat([logits[offsets[i]:offsets[i] + len(drafts[i]) + 1] for i in spec_idx])
            q = []
            for i in spec_idx:
                proposal = samplers[i].proposal
                if proposal is None or proposal.token_ids[:len(drafts[i])] != drafts[i]:
                    raise ValueError(f"{samplers[i].req_id}: the drafts to verify are not the ones proposed")
                q.append(proposal.probs[:len(drafts[i])] if proposal.probs is not None else None)
            rows = [SamplingRow(samplers[i].sampling, samplers[i].generator,
                                samplers[i].token_ids[: samplers[i].num_prompt_tokens], samplers[i].output_token_ids)
                    for i in spec_idx]
            for i, accepted in zip(spec_idx, verify(target, [drafts[i] for i in spec_idx], q, rows)):
                tokens[i] = accepted
        return tokens, logprobs

    def _advance_grammars(self, samplers: list[RequestState], tokens: list[list[int]]) -> None:
        constrained = [i for i, s in enumerate(samplers) if s.matcher is not None]
        if constrained:
            self.grammars.stats["num_constrained_steps"] += 1
            self.grammars.stats["num_constrained_rows"] += len(constrained)
            advance([samplers[i].matcher for i in constrained], [tokens[i] for i in constrained],
                    [samplers[i].req_id for i in constrained])

    def _propose(self, samplers: list[RequestState]) -> list[list[int]]:
        """Drafts for each sampler's next step (none for beams, logprob requests, or when the
        batch is large enough that speculation stops paying)."""
        cfg = self.config
        if self.proposer is None or (cfg.speculative_disable_by_batch_size
                                     and len(samplers) >= cfg.speculative_disable_by_batch_size):
            for state in samplers:
                state.proposal = None
            return []
        # constrained rows never speculate: drafts would have to be checked against the grammar
        wanted = [s for s in samplers if s.append_sampled and s.sampling.logprobs is None and s.matcher is None]
        for state in samplers:
            state.proposal = None
        for state, proposal in zip(wanted, self.proposer.propose(wanted)):
            state.proposal = proposal
        return [s.proposal.token_ids if s.proposal is not None else [] for s in samplers]

    def _prompt_logprobs(self, hidden, wanted) -> dict[str, list[TokenLogprobs | None]]:
        """Logprobs of prompt tokens 1.. given their prefix; the first prompt token has none."""
        done: dict[str, list[TokenLogprobs | None]] = {}
        for state, row0, num in wanted:
            if not state.prompt_logprobs:
                state.prompt_logprobs.append(None)
            lp = self.model.compute_logits(hidden[row0 : row0 + num]).log_softmax(dim=-1)
            start = len(state.prompt_logprobs)  # index of the first prompt token these predict
            targets = torch.tensor(state.token_ids[start : start + num], device=lp.device)
            state.prompt_logprobs.extend(token_logprobs(lp, targets, [state.sampling.prompt_logprobs] * num))
            if len(state.prompt_logprobs) == state.num_prompt_tokens:
                done[state.req_id] = state.prompt_logprobs
        return done

    # ------------------------------------------------------------------ helpers
    def stats(self) -> dict:
        return {
            "num_blocks": self.pool.num_blocks,
            "num_host_blocks": self.pool.num_host_blocks,
            "block_size": self.pool.block_size,
            "bytes_per_block": self.pool_shape.bytes_per_block,
            "num_requests": len(self.requests),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend.name,
            **self.grammars.stats,
        }

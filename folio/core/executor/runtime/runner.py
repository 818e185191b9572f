"""The model runtime: weights, the KV pool, per-request state, and one ``execute`` per step.

The executor service wraps this behind its socket. The scheduler sends per-step diffs (a
``StepPlan``: new requests in full, running ones as new block ids and counts); the runner keeps
what it needs of each request between steps (its tokens, block table, sampling params and the
seed of its draws), flattens the step into one varlen batch, runs the model and samples.
Each plan is checked first (``accept``, ``plan_check.py``): one that does not fit raises
``InvalidPlan`` before any of it is applied.

More in docs/modules.md (folio/core/executor/runtime/runner.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import msgspec
import numpy as np
import torch

from folio.core.executor.kernels import cpu_kernels
from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend, move_slots
from folio.core.executor.kernels.cuda_kernels import UnsupportedKernelError
from folio.core.executor.lora import LoRABatch, LoRAError, LoRAManager
from folio.core.executor.runtime.cuda_graphs import graph_memory_estimate, make_decode_graphs, uses_graphs
from folio.core.executor.runtime.input_batch import NO_LOGPROBS, InputBatch, StepInputs
from folio.core.executor.runtime.encoder_cache import ImageInputs
from folio.core.executor.runtime.mrope import MRopePositions
from folio.core.executor.runtime.pooling import encoder_pooled, pool_vectors
from folio.core.executor.runtime.plan_check import InvalidPlan, PlanLimits, check_plan
from folio.core.executor.kernels.kv_quant import FP8_DTYPE, cache_dtype, raw, stored
from folio.core.kv.tensors.calibration import calibrate_kv_scales, calibration_ids
from folio.core.kv.tensors.pool import KVPool, PoolShape, blocks_for_budget, cpu_kv_budget_bytes, gpu_num_blocks
from folio.core.executor.model.loader import load_model, resolve_dtype
from folio.core.executor.model.layers import PackedLinear, cpu_linear_packing_available, pack_linears_for_cpu
from folio.core.executor.parallel.comm import Comm, Shard
from folio.core.executor.quant.linear import QuantLinear, QuantLMHead, activation_dtype
from folio.core.executor.sampling.penalties import has_penalties
from folio.core.executor.sampling.rejection import verify, verify_tree
from folio.core.executor.sampling.sampler import FREQUENCY, PRESENCE, REPETITION, SamplingBatch, SamplingRow, sample_batch, token_logprobs
from folio.core.executor.runtime.spec_control import SpecController, make_proposer
from folio.core.executor.runtime.spec_decode import DraftTree, Proposal
from folio.core.executor.runtime.spec_config import LORA_REFUSAL, speculative_settings
from folio.core.structured.masks import (GrammarStore, advance, apply_grammar_masks, compile_error, draft_masks,
                                         grammar_prefix)
from folio.core.executor import startup
from folio.shared.config import RuntimeConfig
from folio.shared.messages import Grammar, NewRequestData, StepPlan, StepResult, TokenLogprobs
from folio.shared.sampling import SamplingParams


LORA_DEFAULTS = {"enable_lora": False, "max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": None, "lora_modules": ()}


class _RowColumn:
    """A read-only attribute: the request's entry in one column of the persistent batch."""

    def __init__(self, column: str):
        self.column = column

    def __get__(self, state, owner=None):
        return self if state is None else int(getattr(state.batch, self.column)[state.row])

    def __set__(self, state, value):
        raise AttributeError(f"{self.column} is the batch's: change it there")


class RunnerRequest:
    """What the runner keeps of a request besides its row of the persistent batch."""

    seed = _RowColumn("seeds")  # the key of its draws: its own seed, or the random one drawn when it joined
    num_prompt_tokens = _RowColumn("num_prompt")
    adapter = _RowColumn("lora_ids")
    num_computed_tokens = _RowColumn("num_computed")

    def __init__(self, req_id: str, row: int, batch: InputBatch, sampling: SamplingParams, append_sampled: bool,
                 grammar: Grammar | None = None):
        self.req_id, self.row, self.batch, self.sampling = req_id, row, batch, sampling
        self.grammar = grammar  # structured output: every token it samples keeps inside it
        self.append_sampled = append_sampled  # False for beams: the scheduler sends their tokens
        self.prompt_logprobs: list[TokenLogprobs | None] = []
        self.proposal: Proposal | None = None  # the drafts proposed after its last step, with their q
        self.matcher: object | None = None  # structured output: its grammar's state after its tokens

    @property
    def token_ids(self) -> list[int]:
        return self.batch.tokens(self.row).tolist()

    @property
    def output_token_ids(self) -> list[int]:
        return self.batch.tokens(self.row)[self.num_prompt_tokens :].tolist()


def rope_rows(model) -> int:
    """The positions the model's RoPE tables hold (every table: Gemma 3 has a second one)."""
    local = getattr(model, "local_rope", None)
    tables = [t for t in (getattr(model, "rope_cos", None), getattr(local, "rope_cos", None)) if t is not None]
    rows = min((t.shape[0] for t in tables), default=model.spec.max_position_embeddings)
    return rows - getattr(model, "rope_extra_rows", 0)  # (M-RoPE's rows for image tokens are no positions)


def _without(plan: StepPlan, req_ids: set[str]) -> StepPlan:
    """``plan`` less the requests ``req_ids`` (scheduled, new, running, drafts, KV pulls)."""
    named = set(plan.num_scheduled_tokens) | {r.req_id for r in plan.new_reqs} | {r.req_id for r in plan.running_reqs}
    if named.isdisjoint(req_ids):
        return plan
    return msgspec.structs.replace(
        plan, num_scheduled_tokens={r: n for r, n in plan.num_scheduled_tokens.items() if r not in req_ids},
        new_reqs=[r for r in plan.new_reqs if r.req_id not in req_ids],
        running_reqs=[r for r in plan.running_reqs if r.req_id not in req_ids],
        spec_token_ids={r: d for r, d in plan.spec_token_ids.items() if r not in req_ids},
        kv_loads=[load for load in plan.kv_loads if load.req_id not in req_ids])


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device, model_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                 model=None, batch_invariant: bool = False):
    """``auto`` picks the CUDA kernels on a GPU when CuPy is importable, and on the CPU the C
    kernels (``cpu_backend``) for a model with quantized linears, or for any fp32 model when
    ``batch_invariant`` (every token through the same per-row kernels), else the torch backend
    (the reference); ``cpu`` asks for the C kernels whatever the weights."""
    if name not in ("auto", "torch", "cuda", "cpu"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, cuda or cpu")
    if name == "cpu" and device.type != "cpu":
        raise ValueError("the cpu attention backend runs on the CPU")
    if getattr(model, "encoder_only", False):  # its layers attend within each input themselves (bert.py)
        return TorchAttentionBackend()
    if device.type == "cpu" and name in ("auto", "cpu") and model is not None:
        quantized = model.quantization not in (None, "none")
        if name == "cpu" or quantized or batch_invariant:
            from folio.core.executor.kernels.cpu_backend import make_cpu_backend

            backend = make_cpu_backend(model, model_dtype, kv_dtype,
                                       activation_dtype(model) if quantized else model_dtype, batch_invariant)
            if backend is not None:
                return backend
            if name == "cpu":
                raise ValueError("the cpu attention backend needs fp32 weights and pool and a C compiler")
    if name in ("torch", "cpu") or device.type != "cuda":
        if name == "cuda":
            raise ValueError("the cuda attention backend needs a CUDA device")
        return TorchAttentionBackend()
    try:
        from folio.core.executor.kernels.cuda_backend import CudaAttentionBackend
    except ImportError as exc:
        if name == "cuda":
            raise ValueError(f"the cuda attention backend is unavailable: {exc}") from exc
        return TorchAttentionBackend()
    try:
        return CudaAttentionBackend(model_dtype, kv_dtype=kv_dtype, batch_invariant=batch_invariant)
    except UnsupportedKernelError:  # fp32 activations over an fp8 pool: no kernel instances
        if name == "cuda":
            raise
        return TorchAttentionBackend()


def _settled_config(config: RuntimeConfig, shard: Shard, enable_lora: bool, spec_settings) -> RuntimeConfig:
    """The config a runner runs: refusals said before anything loads, and eager steps where decode
    graphs cannot capture the work (eagle3's hidden states, LoRA's per-step delta, collectives)."""
    if enable_lora and shard.size > 1:
        raise ValueError("LoRA adapters need tensor_parallel_size 1")
    if spec_settings is not None and enable_lora:
        raise ValueError(LORA_REFUSAL)
    eager = enable_lora or shard.size > 1
    if spec_settings is not None and spec_settings.method == "eagle3":
        if shard.size > 1:
            raise ValueError("eagle3 draft heads need tensor_parallel_size 1: the head reads the whole "
                             "model's hidden states and embeddings on one rank")
        eager = True
    return dataclasses.replace(config, enforce_eager=True) if eager else config


class ModelRunner:
    def __init__(self, config: RuntimeConfig, model_path: str, shard: Shard = Shard(), comm: Comm | None = None,
                 device: torch.device | None = None, **lora_options):
        """``lora_options``: ``enable_lora``, ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``,
        ``lora_modules`` (``NAME=PATH`` strings), each overriding the config's field of that name."""
        lora = {k: lora_options.pop(k, getattr(config, k, d)) for k, d in LORA_DEFAULTS.items()}
        if lora_options:
            raise TypeError(f"unknown argument(s) {', '.join(sorted(lora_options))}")
        self.spec_settings = speculative_settings(config)  # before loading anything: a refusal is said at once
        self.config = config = _settled_config(config, shard, lora["enable_lora"], self.spec_settings)
        self.shard, self.comm = shard, comm
        self.device = device if device is not None else resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = load_model(model_path, self.dtype, self.device, config.quantization, shard=shard, comm=comm)
        self.spec = self.model.spec
        self.mrope = self._mrope()  # M-RoPE (Qwen2.5-VL): before anything keeps the RoPE tables' address
        kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        self._set_kernels(kv_dtype)
        self.tree = self._draft_tree() if self.spec_settings is not None and shard.rank == 0 else None
        if getattr(self.model, "images_attend_both_ways", False):
            self._check_whole_images()
        self.pool_shape = PoolShape(
            num_layers=self.spec.num_layers,
            block_size=config.block_size,
            num_kv_heads=self.model.layers[0].self_attn.num_kv_heads,  # this rank's KV heads
            head_dim=self.spec.head_dim,
            dtype=kv_dtype,
        )
        self.kv_scales = calibrate_kv_scales(self.model, self.backend, self.device, config.block_size,
                                             calibration_ids(model_path, self.spec.vocab_size)) \
            if kv_dtype == FP8_DTYPE else []
        with startup.phase("pool"):
            self.pool = KVPool(self.pool_shape, self._decide_num_blocks(), self.device, config.num_host_blocks)
        self.tiers = self._make_tiers(model_path)  # the disk tier, with --kv-disk-dir
        self.requests: dict[str, RunnerRequest] = {}
        self.image_inputs = ImageInputs(self.model, self.device)  # images in: pixels and the encoder-output cache
        self._want_prompt_lp: set[str] = set()  # requests whose prompt logprobs are not all reported
        self.batch = InputBatch(config.max_num_seqs, self.spec.vocab_size, config.block_size, self.device)
        self.limits = PlanLimits(num_blocks=self.pool.num_blocks, num_host_blocks=self.pool.num_host_blocks,
                                 block_size=config.block_size, max_positions=rope_rows(self.model),
                                 vocab_size=self.spec.vocab_size, disk_tier=self.tiers is not None,
                                 max_loras=lora["max_loras"] if lora["enable_lora"] else 0,
                                 takes_images=hasattr(self.model, "encode_images"),
                                 images_both_ways=getattr(self.model, "images_attend_both_ways", False))
        # requests of refused plans: the scheduler ends them, but a plan it made ahead may name them
        # still; they are left out of every plan until it reports them finished
        self._refused: set[str] = set()
        self.table_sampler = cpu_kernels.TableSampler(self.spec.vocab_size) \
            if self.device.type == "cpu" and cpu_kernels.library() is not None else None
        # drafts are proposed on rank 0 alone (a draft model is loaded whole there)
        self.proposer = make_proposer(config, self.model, self.device, self.dtype, self.backend,
                                      self.pool.num_blocks) if shard.rank == 0 else None
        self.spec_control = SpecController(payoff=self.spec_settings.payoff) \
            if self.proposer is not None and self.spec_settings.adaptive else None
        # with a tree: whether a drafting step drafts the tree or a chain, from their measured speed
        self.tree_control = SpecController(payoff=self.spec_settings.payoff) \
            if self.tree is not None and self.spec_control is not None else None
        self.drafts_now = True  # whether the next proposing step proposes (``StepResult.drafts_next``)
        if self.spec_control is not None:
            self.spec_control.first_decision(self.drafts_now)
        self.appended: list[tuple[str, list[int]]] | None = [] if shard.size > 1 else None
        self.grammars = GrammarStore(model_path, self.spec.vocab_size)
        self._constrained: set[str] = set()  # requests with a grammar
        self.graphs = make_decode_graphs(config, self.model, self.backend, self.pool.kv_caches, self.device)
        self.lora: LoRAManager | None = self._make_lora(lora) if lora["enable_lora"] else None

    def _mrope(self) -> MRopePositions | None:
        if not hasattr(self.model, "mrope_rows"):
            return None
        if self.spec_settings is not None:
            raise ValueError(f"speculative decoding does not run {self.spec.model_type} (M-RoPE positions) in this "
                             "build: leave out --speculative-config")
        return MRopePositions(self.model, self.config.max_num_batched_tokens)

    def _check_whole_images(self) -> None:
        """A model whose image placeholders attend each other both ways (Gemma 3) needs a backend
        that attends them so and a step that can hold one image's placeholders whole."""
        if not getattr(self.backend, "attends_image_spans", False):
            raise ValueError(f"{self.spec.model_type} images attend their placeholders both ways, which the "
                             f"{self.backend.name} attention backend does not: use --attention-backend torch "
                             f"(or the CPU's cpu backend)")
        if self.config.max_num_batched_tokens < self.model.image_length:
            raise ValueError(f"--max-num-batched-tokens {self.config.max_num_batched_tokens} is below one image's "
                             f"{self.model.image_length} placeholders, which a {self.spec.model_type} step computes "
                             f"whole: raise it to at least {self.model.image_length}")

    def _draft_tree(self) -> DraftTree | None:
        """The configured tree's shape; ValueError where tree drafts cannot be verified."""
        if self.spec_settings.tree is None:
            return None
        if not getattr(self.backend, "verifies_trees", False):
            raise ValueError(f"tree drafts are verified by the torch and cpu attention backends, not "
                             f"{self.backend.name}: leave \"tree\" out of --speculative-config")
        if any(self.spec.layer_windows):
            raise ValueError("tree drafts are not verified in sliding-window layers: leave \"tree\" out of "
                             "--speculative-config for this model")
        return DraftTree.from_paths(self.spec_settings.tree)

    def _set_kernels(self, kv_dtype: torch.dtype) -> None:
        """The model's layers on folio's kernels or torch's, and the attention backend (whose dtypes
        follow the layers')."""
        config = self.config
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_linear_packing_available():
            pack_linears_for_cpu(self.model)
        for module in self.model.modules():
            if isinstance(module, (QuantLinear, QuantLMHead)):
                module.set_int8_activations(config.cpu_quant_activations == "int8")
        QuantLinear.passes = config.cpu_activation_passes  # one model a process: the layers' and the stack's
        self.backend = make_backend(config.attention_backend, self.device, self.dtype, kv_dtype, self.model,
                                    batch_invariant=config.batch_invariant)
        if config.batch_invariant and self.device.type == "cuda" and getattr(self.backend, "batch_invariant", False):
            from folio.core.executor.kernels.gemm_kernels import make_linears_batch_invariant
            from folio.core.executor.quant.gpu import AwqLinear

            # the projections and the LM head off cuBLAS; W4A16 layers in their own invariant mode
            make_linears_batch_invariant(self.model, own_mode=(AwqLinear,))
        for module in self.model.modules():  # the layers whose kernels change order with the call's rows
            if isinstance(module, (PackedLinear, QuantLMHead)):
                module.batch_invariant = config.batch_invariant

    def _make_lora(self, lora: dict) -> LoRAManager:
        # over a quantized base on the CPU the adapters take the layers' activations' dtype (bf16 for
        # torch's packed kernels: AMX GEMMs)
        quantized = self.device.type == "cpu" and self.model.quantization not in (None, "none")
        manager = LoRAManager(self.model, lora["max_loras"], lora["max_lora_rank"], lora["max_cpu_loras"],
                              self.device, activation_dtype(self.model) if quantized else self.dtype)
        manager.attach()
        for module in lora["lora_modules"] or ():
            name, sep, path = module.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"a LoRA module is NAME=PATH, not {module!r}")
            manager.add(name, path)
        return manager

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, name: str, path: str) -> None:
        """Register (or replace) an adapter; raises ``LoRAError`` (a ValueError) saying why it
        cannot be served, changing nothing."""
        if self.lora is None:
            raise LoRAError("LoRA adapters are not enabled (enable_lora)")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        if self.lora is None:
            raise LoRAError("LoRA adapters are not enabled (enable_lora)")
        self.lora.remove(name)

    def lora_names(self) -> list[str]:
        return self.lora.names() if self.lora is not None else []

    def _lora_step(self, step: StepInputs) -> None:
        """The step's adapters into device slots and each token's slot (vectorised over the
        scheduled sequences: one lookup per distinct adapter)."""
        ids = self.batch.lora_ids[step.rows]
        if not ids.any():
            self.lora.set_step(None)
            return
        distinct = np.unique(ids[ids > 0])
        try:
            names = [self.lora.name_of_id[i] for i in distinct.tolist()]
        except KeyError:
            raise LoRAError("a scheduled request's LoRA adapter was removed") from None
        slots = self.lora.activate(names)
        slot_of_id = np.full(int(distinct[-1]) + 1, -1, dtype=np.int64)
        slot_of_id[distinct] = [slots[n] for n in names]
        self.lora.set_step(LoRABatch.build(slot_of_id[ids], step.counts, self.lora.scales, self.lora.widths,
                                           self.device))

    def _forward(self, step: StepInputs, embeds=None) -> torch.Tensor:
        if self.lora is not None:
            self._lora_step(step)
        if embeds is not None:  # an image's placeholders: the vision tower's rows in place of embeddings
            return self.model(step.input_ids, step.meta.positions, self.pool.kv_caches, step.meta, self.backend,
                              embeds=embeds)
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step)
        return self.model(step.input_ids, step.meta.positions, self.pool.kv_caches, step.meta, self.backend)

    # ------------------------------------------------------------------ pool sizing
    def _decide_num_blocks(self) -> int:
        """The same block ids on every rank: the smallest pool any rank can hold."""
        num_blocks = self._local_num_blocks()
        return num_blocks if self.comm is None else self.comm.all_min(num_blocks)

    def _local_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cpu":
            budget = self.config.kv_cache_bytes or cpu_kv_budget_bytes()
            return blocks_for_budget(budget, self.pool_shape)
        peak, activations = self._profile_gpu_peak()
        if uses_graphs(self.config, self.spec, self.backend, self.device):
            peak += graph_memory_estimate(self.config, activations)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return gpu_num_blocks(total, self.config.gpu_memory_utilization, peak, self.pool_shape)

    def _profile_gpu_peak(self) -> tuple[int, int]:
        """Peak memory (weights + activations, no KV) of a forward pass at the largest batch, and
        the activations' share of it."""
        num_tokens = self.config.max_num_batched_tokens
        num_seqs = max(1, min(self.config.max_num_seqs, num_tokens))
        bs = self.config.block_size
        lens = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        blocks_per_seq = [(n + bs - 1) // bs for n in lens]
        scratch = KVPool(self.pool_shape, sum(blocks_per_seq), self.device)
        scratch_bytes = scratch.num_bytes
        tables, start = [], 0
        for nb in blocks_per_seq:
            tables.append(list(range(start, start + nb)))
            start += nb
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        meta = AttentionMetadata.build(lens, lens, tables, None, bs, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, meta.positions, scratch.kv_caches, meta, self.backend)
            self.model.compute_logits(hidden[-num_seqs:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        torch.cuda.empty_cache()
        return peak - scratch_bytes, peak - before

    # ------------------------------------------------------------------ request state
    def _add_request(self, new: NewRequestData) -> None:
        if new.req_id in self.requests:
            self._drop(new.req_id)
        lora_id = self.lora.id_of(new.lora_name) if new.lora_name is not None else 0  # (checked: check_plan)
        row = self.batch.add(new.req_id, new.token_ids, new.num_prompt_tokens, new.num_computed_tokens,
                             new.block_ids, new.sampling, new.append_sampled, lora_id)
        self.requests[new.req_id] = RunnerRequest(new.req_id, row, self.batch, new.sampling, new.append_sampled,
                                                  new.grammar)
        self.image_inputs.add(new.req_id, new.images)
        if self.mrope is not None:
            self.mrope.add(new.req_id, new.images)
        if new.sampling.prompt_logprobs is not None:
            self._want_prompt_lp.add(new.req_id)
        if new.grammar is not None:  # compiled meanwhile; its matcher is made when it samples
            self.grammars.prepare(new.grammar)  # (the scheduler's ask started it already)
            self._constrained.add(new.req_id)

    def _drop(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if self.proposer is not None:  # the suffix proposer remembers what the request said
            self.proposer.drop(req_id, *((state.token_ids, state.adapter) if state is not None else ()))
        if state is not None:
            self.batch.remove(req_id)
        self.image_inputs.drop(req_id)
        if self.mrope is not None:
            self.mrope.drop(req_id)
        self._want_prompt_lp.discard(req_id)
        self._constrained.discard(req_id)

    def _update_states(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:  # (rank 0 dropped them already in ``accept``)
            self._drop(req_id)
        for new in plan.new_reqs:
            self._add_request(new)
        self.batch.apply_running(plan.running_reqs, plan.step_id)

    def _make_tiers(self, model_path: str):
        disk_dir = getattr(self.config, "kv_disk_dir", None)
        if not disk_dir:
            return None
        from folio.core.kv.tensors.disk import KVTierStore, pool_layout_id
        from folio.core.kv.tiers import DiskTier

        ident = pool_layout_id(self.pool, model_path, self.config.quantization, str(self.dtype), self.kv_scales,
                               self.shard.rank, self.shard.size)
        cap = int(float(getattr(self.config, "kv_disk_gb", 10.0)) * 1e9)
        return KVTierStore(self.pool, DiskTier(disk_dir, ident, cap, self.pool_shape.bytes_per_block))

    def _copy_blocks(self, plan: StepPlan) -> None:
        """The kvmanager's copies, before the step reads the pool: disk-tier saves first (they
        read blocks that this step may write again), then swap-outs (the blocks they vacate may be
        written by swap-ins, copies or this step), then swap-ins, disk-tier loads, copy-on-write.
        ``check_plan`` saw that each block lies in its pool and that the tiers exist."""
        if plan.tier_saves:
            self.tiers.save(plan.tier_saves, protect=[h for _, h in plan.tier_loads])
        swap_in, host_in = plan.swap_in, self.pool.host_caches
        if swap_in and plan.swap_out and {h for _, h in plan.swap_out} & {h for h, _ in swap_in}:
            # a host block a swap-in reads is rewritten by a swap-out of the same step (the allocator
            # gave it back and took it again, for a prefix the device evicts): read it first
            idx = torch.tensor([h for h, _ in swap_in], dtype=torch.long)
            host_in = [tuple(stored(raw(c).index_select(0, idx), c.dtype) for c in kv) for kv in host_in]
            swap_in = [(i, d) for i, (_, d) in enumerate(swap_in)]
        if plan.swap_out:
            self.backend.swap_out(self.pool.kv_caches, self.pool.host_caches, plan.swap_out)
        if swap_in:
            self.backend.swap_in(host_in, self.pool.kv_caches, swap_in)
        if plan.tier_loads:
            self.tiers.load(plan.tier_loads)
        if plan.block_copies:
            self.backend.copy_blocks(self.pool.kv_caches, plan.block_copies)

    # ------------------------------------------------------------------ one step
    def accept(self, plan: StepPlan) -> StepPlan:
        """The plan this executor runs: its grammars watched and its finished requests dropped
        (both stand whatever the rest says), the requests of plans refused before left out, the
        rest checked against the pool, the RoPE tables, the vocabulary and the held requests
        before anything of it is applied. Raises ``InvalidPlan`` (the step's requests are then
        refused until reported finished)."""
        for grammar in plan.grammars:
            self.grammars.watch(grammar)
        for req_id in plan.finished_req_ids:
            self._drop(req_id)
            self._refused.discard(req_id)
        if self._refused:
            plan = _without(plan, self._refused)
        try:
            check_plan(plan, self.limits, self.batch, self.lora.ids if self.lora is not None else None)
        except InvalidPlan:  # (an id neither held nor new here is refused again each time)
            new = {r.req_id for r in plan.new_reqs}
            self._refused.update(r for r in itertools.chain(plan.num_scheduled_tokens, new, (
                r.req_id for r in plan.running_reqs)) if r in new or r in self.batch.row_of)
            raise
        return plan

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step; the result also names the grammars the scheduler waits for whose compile
        ended (with nothing to compute it first waits a little for one, ``await_grammars``).
        A plan that does not fit raises ``InvalidPlan`` (``accept``)."""
        result = self._execute(self.accept(plan))
        if plan.await_grammars and not plan.num_scheduled_tokens:
            self.grammars.wait_watched()
        ready, errors = self.grammars.take_reports()
        if ready or errors:
            result = msgspec.structs.replace(result, grammars_ready=ready, grammar_errors=errors)
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        forward = self._step_forward(plan)
        if forward is None:
            return StepResult(step_id=plan.step_id)
        hidden, step, req_ids, result_prompt_lp = forward
        pooled = self._pool(hidden, step, req_ids) if step.pools is not None else {}
        if not step.samples.any():
            return StepResult(step_id=plan.step_id, prompt_logprobs=result_prompt_lp, pooled=pooled)
        logits = self.model.compute_logits(hidden.index_select(0, step.logits_idx))
        samplers = [req_ids[i] for i in np.flatnonzero(step.samples)] if not step.samples.all() else req_ids
        constrained, failed = self._matchers(samplers)
        sampled, logprobs = self._sample(logits, step, samplers, plan, constrained)
        if constrained:
            self._advance_grammars(samplers, sampled.sampled_token_ids())
        if self.spec_control is not None:  # this step's speed, for the arm its drafts were chosen by
            decode_only = bool((step.counts - step.num_spec == 1).all() and step.samples.all())
            per_request = dict(zip(sampled.req_ids or samplers, map(len, sampled.sampled_token_ids()))) \
                if self.spec_control.payoff == "closed" else None
            self.spec_control.observe(time.perf_counter() - start, len(sampled.token_ids), decode_only, per_request)
            if self.tree_control is not None:  # a drafting step's speed, for the shape its drafts had
                self.tree_control.observe(time.perf_counter() - start, len(sampled.token_ids), decode_only,
                                          per_request)
        spec = self._propose([self.requests[r] for r in samplers]) if self.proposer else []
        if failed:  # their grammar did not compile: no token (the scheduler ends them with the reason)
            keep = [i for i, r in enumerate(samplers) if r not in failed]
            per_request = sampled.sampled_token_ids()
            sampled = StepResult(step_id=plan.step_id, **StepResult.flat([per_request[i] for i in keep]))
            samplers, logprobs = [samplers[i] for i in keep], [logprobs[i] for i in keep]
            spec = [spec[i] for i in keep] if spec else spec
        return msgspec.structs.replace(sampled, req_ids=samplers, logprobs=logprobs, prompt_logprobs=result_prompt_lp,
                                       spec_token_ids=spec, drafts_next=self.drafts_now, pooled=pooled)

    def _step_forward(self, plan: StepPlan):
        """The plan's diffs, copies and forward pass (and prompt logprobs): what every rank runs."""
        self._update_states(plan)
        self._copy_blocks(plan)
        if not plan.num_scheduled_tokens:
            return None
        step = self.batch.prepare(plan.num_scheduled_tokens, plan.spec_token_ids, self._trees(plan))
        req_ids = list(plan.num_scheduled_tokens)
        starts = self.batch.num_computed[step.rows]  # each scheduled request's first index this step
        embeds = self.image_inputs.step_embeds(req_ids, starts, step.counts)
        if self.mrope is not None:  # text at its index plus its request's delta, images at their rows
            positions = self.mrope.step_positions(req_ids, starts, step.counts, self.device)
            if positions is not None:
                step.meta.positions = positions
        if embeds is not None and getattr(self.model, "images_attend_both_ways", False):
            step.meta.image_spans = self.image_inputs.step_spans(req_ids, starts, step.counts)
        hidden = self._forward(step, embeds)
        if self.proposer is not None and hasattr(self.proposer, "observe"):  # a draft head reads the hidden states
            self.proposer.observe(req_ids, starts, step.counts, hidden)
        result_prompt_lp = self._prompt_logprobs(hidden, step, req_ids)
        self.batch.num_computed[step.rows] += step.counts
        return hidden, step, req_ids, result_prompt_lp

    @torch.inference_mode()
    def follow(self, plan: StepPlan, appended: list[tuple[str, list[int]]]) -> None:
        """A rank other than 0: rank 0's tokens of the last step, then this step without sampling
        (the logits are computed all the same: their gather is a collective)."""
        for req_id, token_ids in appended:
            state = self.requests.get(req_id)
            if state is not None:
                self.batch.append_tokens(state.row, token_ids)
        forward = self._step_forward(plan)
        if forward is not None and forward[1].pools is not None:
            self._pool(*forward[:3])  # a score's logits are gathered over the ranks too
        if forward is not None and forward[1].samples.any():
            hidden, step = forward[0], forward[1]
            self.model.compute_logits(hidden.index_select(0, step.logits_idx))

    def take_appended(self) -> list[tuple[str, list[int]]]:
        """Rank 0: the tokens it appended since the last call, for the other ranks."""
        out, self.appended = self.appended or [], []
        return out

    def _matchers(self, samplers: list[str]) -> tuple[bool, set[str]]:
        """Whether some sampler has a grammar (a fresh matcher replays what its request
        generated), and the samplers whose grammar failed to compile."""
        found, failed = False, set()
        if not self._constrained:
            return found, failed
        for req_id in self._constrained.intersection(samplers):
            state = self.requests[req_id]
            if state.matcher is None:
                try:
                    state.matcher = self.grammars.matcher(state.grammar, state.output_token_ids)
                except Exception as exc:  # a compile that failed: this request alone fails
                    self.grammars.failed[state.grammar.key] = compile_error(exc)
                    failed.add(req_id)
                    continue
            found = True
        return found, failed

    def _advance_grammars(self, samplers: list[str], tokens: list[list[int]]) -> None:
        constrained = [i for i, r in enumerate(samplers) if self.requests[r].matcher is not None]
        if constrained:
            self.grammars.stats["num_constrained_steps"] += 1
            self.grammars.stats["num_constrained_rows"] += len(constrained)
            advance([self.requests[samplers[i]].matcher for i in constrained], [tokens[i] for i in constrained],
                    [samplers[i] for i in constrained])

    def _sample(self, logits: torch.Tensor, step: StepInputs, samplers: list[str], plan: StepPlan,
                constrained: bool) -> tuple[StepResult, list]:
        """The batched sampler for the rows without drafts; verification (rejection sampling) for
        the others. ``logits`` holds one row per plain sampler and ``drafts + 1`` per verifier.
        Returns the step's result with only its tokens set (flat), and the logprobs."""
        spec = step.num_spec[step.samples]  # per sampler
        plain = spec == 0
        num_logits = spec + 1
        offsets = np.cumsum(num_logits) - num_logits
        plain_logits = logits if plain.all() else logits.index_select(
            0, torch.as_tensor(offsets[plain], device=logits.device))
        matchers = [self.requests[samplers[i]].matcher for i in np.flatnonzero(plain)] if constrained else None
        tokens_dev = self._sample_plain(plain_logits, step, matchers) if plain.any() else torch.zeros(0, dtype=torch.long)
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(samplers)
        want = self.batch.num_logprobs[step.sample_rows]
        plain_pos = np.flatnonzero(plain)
        if (want != NO_LOGPROBS).any():
            idx = np.flatnonzero(want != NO_LOGPROBS)
            sel = torch.as_tensor(idx, device=logits.device)
            reported = token_logprobs(plain_logits[sel].log_softmax(dim=-1), tokens_dev[sel], want[idx].tolist())
            for i, lp in zip(idx, reported):
                logprobs[plain_pos[i]] = [lp]
        plain_tokens = tokens_dev.cpu().numpy()  # the step's one wait on the device
        appends = self.batch.appends[step.sample_rows]
        if self.proposer is not None:
            self._rollback_drafts([samplers[i] for i in plain_pos], appends)
        self.batch.append_sampled(step.sample_rows[appends], plain_tokens[appends])
        if self.appended is not None:
            self.appended.extend((samplers[i], [int(plain_tokens[j])]) for j, i in enumerate(plain_pos) if appends[j])
        if plain.all():
            return StepResult(step_id=plan.step_id, token_ids=plain_tokens.tolist()), logprobs
        tokens: list[list[int]] = [[] for _ in samplers]
        for i, t in zip(plain_pos, plain_tokens.tolist()):
            tokens[i] = [t]
        spec_pos = np.flatnonzero(~plain)
        for i, accepted in zip(spec_pos, self._verify(logits, [self.requests[samplers[i]] for i in spec_pos],
                                                       [int(offsets[i]) for i in spec_pos], plan)):
            tokens[i] = accepted
        return StepResult(step_id=plan.step_id, **StepResult.flat(tokens)), logprobs

    def _sample_plain(self, logits: torch.Tensor, step: StepInputs, matchers: list | None) -> torch.Tensor:
        rows, batch = step.sample_rows, self.batch
        seeds, positions = batch.keys(rows)  # each row's draws: keyed by its seed and output position
        if self.table_sampler is not None and (matchers is not None or batch.penalised[rows].any()
                                               or not batch.greedy[rows].all()) \
                and logits.shape[1] == batch.vocab_size and cpu_kernels.usable(logits):
            # the C kernel over the persistent rows, every row whatever the others are (grammar rows
            # masked first): penalties, draw and penalty bookkeeping in one call (a batch that is all
            # plain greedy takes numpy's argmax below: the same tokens, no setup)
            if matchers is not None:
                logits = apply_grammar_masks(logits, matchers)
            tokens = self.table_sampler.sample(logits, step.sample_rows_dev, batch.greedy, batch.params,
                                               batch.penalties, seeds, positions)
            batch.last_sampled.index_copy_(0, step.sample_rows_dev, tokens)
            return tokens
        sampling = SamplingBatch(step.sample_params, batch.greedy[rows], batch.params[rows], seeds, positions,
                                 matchers=matchers)
        penalised = bool(batch.penalised[rows].any())
        if penalised:
            sampling.bias, sampling.rep = batch.penalties.gather(step.sample_rows_dev, bool(batch.repetition[rows].any()),
                                                                 rows)
        tokens = sample_batch(logits, sampling)
        if penalised:  # rows without penalties never read their state: it is reset when a row is reused
            batch.penalties.record(step.sample_rows_dev, tokens, step.sample_params[:, FREQUENCY],
                                   step.sample_params[:, PRESENCE], step.sample_params[:, REPETITION])
        batch.last_sampled.index_copy_(0, step.sample_rows_dev, tokens)
        return tokens

    def _rollback_drafts(self, req_ids: list[str], appends: np.ndarray) -> None:
        """A request that had a proposal but verified none of it: the draft's cache drops them."""
        for req_id, append in zip(req_ids, appends):
            state = self.requests[req_id]
            if append and state.proposal is not None:
                self.proposer.rollback(req_id, int(self.batch.num_tokens[state.row]))

    def _trees(self, plan: StepPlan) -> dict[str, DraftTree] | None:
        """The requests whose drafts this step verifies are a tree, with its shape."""
        if self.tree is None or not plan.spec_token_ids:
            return None
        out = {}
        for req_id, drafts in plan.spec_token_ids.items():
            state = self.requests.get(req_id)
            if drafts and state is not None and state.proposal is not None and state.proposal.tree is not None:
                out[req_id] = state.proposal.tree
        return out or None

    def _verify(self, logits: torch.Tensor, states: list[RunnerRequest], offsets: list[int], plan: StepPlan):
        trees = [s.proposal is not None and s.proposal.tree is not None for s in states]
        if any(trees):  # tree drafts are verified one request at a time, the chains together
            out: list[list[int] | None] = [None] * len(states)
            chains = [i for i, t in enumerate(trees) if not t]
            if chains:
                for i, new in zip(chains, self._verify(logits, [states[i] for i in chains],
                                                       [offsets[i] for i in chains], plan)):
                    out[i] = new
            for i in np.flatnonzero(trees):
                out[i] = self._verify_tree(logits, states[i], offsets[i], plan)
            return out
        drafts = [plan.spec_token_ids[s.req_id] for s in states]
        ends = [o + len(d) + 1 for o, d in zip(offsets, drafts)]
        if all(o == e for o, e in zip(offsets[1:], ends)):  # one run of rows (every sampler verifies): a view
            target = logits[offsets[0] : ends[-1]]
        else:
            target = torch.cat([logits[o:e] for o, e in zip(offsets, ends)])
        q = []
        for state, d in zip(states, drafts):
            proposal = state.proposal
            if proposal is None or proposal.token_ids[: len(d)] != d:
                raise ValueError(f"{state.req_id}: the drafts to verify are not the ones proposed")
            q.append(proposal.probs[: len(d)] if proposal.probs is not None else None)
        rows = [SamplingRow(s.sampling, None, s.token_ids[: s.num_prompt_tokens], s.output_token_ids, seed=s.seed)
                for s in states]
        target = self._mask_drafts(target, states, drafts)
        out = verify(target, drafts, q, rows)
        for state, new in zip(states, out):
            if state.append_sampled:
                self.proposer.rollback(state.req_id, int(self.batch.num_tokens[state.row]) + len(new) - 1)
                self.batch.append_tokens(state.row, new)
                self._record(state, new)
                if self.appended is not None:
                    self.appended.append((state.req_id, list(new)))
        return out

    def _verify_tree(self, logits: torch.Tensor, state: RunnerRequest, offset: int, plan: StepPlan) -> list[int]:
        """One request's tree (``rejection.verify_tree``); the accepted path's KV is moved to the
        slots of its positions (the root's next ones), where the next steps read it."""
        drafts, proposal = plan.spec_token_ids[state.req_id], state.proposal
        if proposal.token_ids[: len(drafts)] != drafts:
            raise ValueError(f"{state.req_id}: the drafts to verify are not the ones proposed")
        row = SamplingRow(state.sampling, None, state.token_ids[: state.num_prompt_tokens], state.output_token_ids,
                          seed=state.seed)
        new, path = verify_tree(logits[offset: offset + len(drafts) + 1], proposal.tree.children(len(drafts)),
                                drafts, row)
        root = int(self.batch.num_tokens[state.row]) - 1  # the root's position: the request's last token
        moves = [(root + c, root + d) for d, c in enumerate(path, start=1) if c != d]
        if moves:
            table, bs = self.batch.block_table[state.row], self.batch.block_size
            slots = [[int(table[p // bs]) * bs + p % bs for p in pair] for pair in moves]
            move_slots(self.pool.kv_caches, [s for s, _ in slots], [d for _, d in slots])
        if hasattr(self.proposer, "accept_path"):
            self.proposer.accept_path(state.req_id, root, path)
        if state.append_sampled:
            self.proposer.rollback(state.req_id, root + len(new))
            self.batch.append_tokens(state.row, new)
            self._record(state, new)
            if self.appended is not None:
                self.appended.append((state.req_id, list(new)))
        return new

    @staticmethod
    def _mask_drafts(target: torch.Tensor, states: list[RunnerRequest], drafts: list[list[int]]) -> torch.Tensor:
        """Constrained rows: each verified position sees its grammar's mask, as plain sampling does."""
        if all(s.matcher is None for s in states):
            return target
        target, start = target.clone(), 0
        for state, d in zip(states, drafts):
            if state.matcher is not None and not state.matcher.is_terminated():
                allowed = draft_masks(state.matcher, d, target.shape[1]).to(target.device)
                target[start:start + len(d) + 1] = torch.where(allowed, target[start:start + len(d) + 1], float("-inf"))
            start += len(d) + 1
        return target

    def _record(self, state: RunnerRequest, new: list[int]) -> None:
        """Penalty counts and the last sampled token of a verified request."""
        device = self.batch.last_sampled.device
        rows = torch.full((len(new),), state.row, dtype=torch.long, device=device)
        params = torch.as_tensor(self.batch.params[state.row], device=device)
        tokens = torch.as_tensor(new, dtype=torch.long, device=device)
        self.batch.penalties.record(rows, tokens, *(params[col].expand(len(new)) for col in (FREQUENCY, PRESENCE, REPETITION)))
        self.batch.last_sampled[state.row] = new[-1]

    def _propose(self, samplers: list[RunnerRequest]) -> list[list[int]]:
        """Drafts for each sampler's next step (none for beams, logprob requests, or when the
        batch is large enough that speculation stops paying)."""
        limit = self.spec_settings.disable_by_batch_size if self.spec_settings is not None else 0
        speculate = self.proposer is not None and self.drafts_now and not (limit and len(samplers) >= limit)
        if self.spec_control is not None:  # decided a step ahead: the result says it, the scheduler plans ahead
            self.drafts_now = self.spec_control.choose(len(samplers))
        if not speculate:
            for state in samplers:
                state.proposal = None
            if self.spec_control is not None:
                self.spec_control.proposed(len(samplers), False, 0.0)
            return []
        start = time.perf_counter()
        wanted = [s for s in samplers if s.append_sampled and s.sampling.engine_logprobs is None
                  and (s.matcher is None or not s.matcher.is_terminated())]
        for state in samplers:
            state.proposal = None
        use_tree = self.tree is not None and (self.tree_control is None or self.tree_control.choose(len(samplers)))
        if use_tree:  # rows with penalties or a grammar draft chains: a tree's positions have other histories
            trees = [s for s in wanted if s.matcher is None and not has_penalties(s.sampling)]
            for state, proposal in zip(trees, self.proposer.propose_tree(trees, self.tree)):
                state.proposal = proposal
            chose = {id(s) for s in trees}
            wanted = [s for s in wanted if id(s) not in chose]
        for state, proposal in zip(wanted, self.proposer.propose(wanted)):
            if state.matcher is not None:  # a constrained row's drafts stop where its grammar would refuse one
                n = grammar_prefix(state.matcher, proposal.token_ids)
                proposal = Proposal(proposal.token_ids[:n], proposal.probs[:n] if proposal.probs is not None else None)
            state.proposal = proposal
        if self.spec_control is not None:
            self.spec_control.proposed(len(samplers), True, time.perf_counter() - start)
        if self.tree_control is not None:
            self.tree_control.proposed(len(samplers), use_tree, time.perf_counter() - start)
        return [s.proposal.token_ids if s.proposal is not None else [] for s in samplers]

    def _pool(self, hidden: torch.Tensor, step: StepInputs, req_ids: list[str]) -> dict[str, bytes]:
        """The vectors of the pooling requests whose last prompt token ran this step (``pooling.py``)."""
        pooling_ids = [req_ids[i] for i in np.flatnonzero(step.pools)]
        if not pooling_ids:
            return {}
        params = [self.requests[r].sampling.pooling for r in pooling_ids]
        if getattr(self.model, "encoder_only", False):  # each input's tokens pooled (mean or CLS), not its last
            last, params = encoder_pooled(self.model, hidden, step.pool_idx, step.counts[step.pools], params)
        else:
            last = hidden.index_select(0, torch.as_tensor(step.pool_idx, device=hidden.device))
        return pool_vectors(last, params, pooling_ids, self.model.compute_logits)

    def _prompt_logprobs(self, hidden, step: StepInputs, req_ids: list[str]) -> dict[str, list[TokenLogprobs | None]]:
        """Logprobs of prompt tokens 1.. given their prefix; the first prompt token has none."""
        done: dict[str, list[TokenLogprobs | None]] = {}
        if not self._want_prompt_lp:
            return done
        starts = np.cumsum(step.counts) - step.counts
        for i, req_id in enumerate(req_ids):
            if req_id not in self._want_prompt_lp:
                continue
            state = self.requests[req_id]
            start = int(self.batch.num_computed[state.row])
            num = min(start + int(step.counts[i] - step.num_spec[i]), state.num_prompt_tokens - 1) - start
            if num <= 0:
                continue
            if not state.prompt_logprobs:
                state.prompt_logprobs.append(None)
            row0 = int(starts[i])
            lp = self.model.compute_logits(hidden[row0 : row0 + num]).log_softmax(dim=-1)
            first = len(state.prompt_logprobs)  # index of the first prompt token these predict
            targets = torch.as_tensor(state.token_ids[first : first + num], device=lp.device)
            state.prompt_logprobs.extend(token_logprobs(lp, targets, [state.sampling.prompt_logprobs] * num))
            if len(state.prompt_logprobs) == state.num_prompt_tokens:
                done[req_id] = state.prompt_logprobs
                self._want_prompt_lp.discard(req_id)
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
            "kv_cache_dtype": str(self.pool_shape.dtype).removeprefix("torch."),
            "kv_scales": [s.summary() for s in self.kv_scales],  # per layer of an fp8 pool: (largest k, v scale)
            "quantization": self.model.quantization,
            "attention_backend": self.backend.name,
            "cuda_graph_buckets": self.graphs.buckets if self.graphs is not None else [],
            "num_graph_replays": self.graphs.num_replays if self.graphs is not None else 0,
            "tensor_parallel_size": self.shard.size,
            **({"kv_tiers": self.tiers.stats()} if self.tiers is not None else {}),
            **self.grammars.stats,
            **(self.lora.stats() if self.lora is not None else {}),
            **self.image_inputs.stats(),
            **(self.spec_control.stats() if self.spec_control is not None else {}),
            # drafting steps by shape (the tree's controller: its second arm is the tree)
            **({"spec_steps_chain": self.tree_control.num_steps[0], "spec_steps_tree": self.tree_control.num_steps[1]}
               if self.tree_control is not None else {}),
            **(self.proposer.stats() if hasattr(self.proposer, "stats") else {}),
        }

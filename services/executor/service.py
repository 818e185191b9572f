"""The executor service: the model runtime (``ModelRunner``) behind its socket.

More in docs/modules.md (services/executor/service.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import structlog
import zmq
import zmq.asyncio

from folio.core.executor.runtime.plan_check import InvalidPlan
from folio.core.executor.runtime.runner import ModelRunner
from folio.core.executor.runtime.workers import WorkerGroupError
from folio.core.kv.window import all_layers_window
from folio.services.executor.kv_roles import make_kv_role
from folio.core.executor import startup
from folio.shared.config import ExecutorServiceConfig
from folio.services.shell import serve_admin, serve_router
from folio.shared.transport import close_sockets, receive_reply
from folio.shared.messages import PoolInfo, RegisterPool, StepPlan, StepResult
from folio.shared.transport import Decoder, encode, make_socket

log = structlog.get_logger()
REGISTER_EVERY_S = 1.0


class ExecutorService:
    def __init__(self, config: ExecutorServiceConfig, ctx: zmq.asyncio.Context, runner: ModelRunner | None = None):
        self.config = config
        # one thread for all the runner's work, its loading included: per-thread device state
        # (CUDA's current stream) stays put, and on the CPU one OpenMP team serves every step.
        # libgomp gives each thread that opens a parallel region a team of its own; with a second
        # team (the loading thread's) it counts more threads than cores and has its workers sleep
        # between regions instead of spinning, which doubled SmolLM2's decode step at batch 64
        self.step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        startup.PHASES["imports"] = startup.since_process_start()  # the interpreter, torch and folio
        self.runner = runner if runner is not None else self.step_thread.submit(make_runner, config).result()
        self.startup = {**startup.report(), "ready_s": round(startup.since_process_start(), 3)}
        self.runner.grammars.start_loading()  # the vocabulary for structured output, off the step path
        self.epoch = uuid.uuid4().hex
        ep = config.endpoints
        self.recv_from_scheduler = make_socket(ctx, zmq.ROUTER, ep.executor)
        self.send_to_kvmanager = make_socket(ctx, zmq.DEALER, ep.kvmanager, service="kvmanager")
        self.recv_from_admin = make_socket(ctx, zmq.ROUTER, ep.admin_executor)
        self.decoder = Decoder(StepPlan)
        self.handlers = {StepPlan: self.handle_step_plan}
        self.admin_commands = {"stats": self.admin_stats, "lora_list": self.admin_lora_list,
                               "lora_load": self.admin_lora_load, "lora_unload": self.admin_lora_unload}
        self.num_steps = 0
        self.num_steps_queued = 0  # steps whose plan had arrived before the step before ended
        self.num_placeholder_tokens = 0
        self.execute_seconds_total = 0.0
        self.traced = bool(getattr(config, "otlp_traces_endpoint", None))  # each result carries the step's start and end
        # --kv-role prefill|decode: KV transfers around each step (``kv_roles.py``); both: None
        self.kv_role = make_kv_role(config.runtime, self.runner)
        self.execute = self.kv_role.execute if self.kv_role is not None else self.runner.execute

    async def run(self) -> None:
        try:
            await asyncio.gather(
                self.keep_pool_registered(),
                serve_router(self.recv_from_scheduler, self.decoder, self.handlers, log, "scheduler"),
                serve_admin(self.recv_from_admin, self.admin_commands, log),
            )
        finally:
            self.step_thread.shutdown(wait=False)
            if hasattr(self.runner, "close"):
                self.runner.close()
            if self.kv_role is not None:
                self.kv_role.close()
            close_sockets(self.recv_from_scheduler, self.send_to_kvmanager, self.recv_from_admin)

    async def keep_pool_registered(self) -> None:
        """Tell the kvmanager what pool exists (the scheduler starts planning once it knows), and
        keep telling it: a kvmanager that restarts knows nothing until it hears this again."""
        runner = self.runner
        message = encode(RegisterPool(num_blocks=runner.pool.num_blocks, block_size=runner.pool.block_size,
                                      bytes_per_block=runner.pool_shape.bytes_per_block, epoch=self.epoch,
                                      max_model_len=runner.spec.max_position_embeddings,
                                      num_host_blocks=runner.pool.num_host_blocks,
                                      sliding_window=all_layers_window(getattr(runner.spec, "layer_windows", ())),
                                      **_disk_tier_fields(runner)))
        decoder = Decoder(PoolInfo)
        registered = False
        while True:
            await self.send_to_kvmanager.send(message)
            # every reply until a silence of REGISTER_EVERY_S, then tell it again
            while (info := await receive_reply(self.send_to_kvmanager, decoder, log, REGISTER_EVERY_S,
                                               socket_name="kvmanager")) is not None:
                if info.epoch == self.epoch and not registered:
                    registered = True
                    log.info("pool registered", num_blocks=info.num_blocks, block_size=info.block_size,
                             bytes_per_block=info.bytes_per_block, epoch=self.epoch,
                             kv_cache_dtype=str(runner.pool_shape.dtype).removeprefix("torch."))

    async def handle_step_plan(self, plan: StepPlan, envelope: list[bytes]) -> StepResult:
        self.num_steps += 1
        self.num_placeholder_tokens += plan.num_placeholder_tokens
        t0 = time.perf_counter()
        try:
            # off the event loop: its admin socket answers pings (health) during a long step; the
            # router awaits each step, so steps still run one at a time
            if self.traced:  # the scheduler's spans of this step's chunks and decodes take its times
                start_ns = time.time_ns()
                result = await asyncio.get_running_loop().run_in_executor(self.step_thread, self.execute, plan)
                return msgspec.structs.replace(result, epoch=self.epoch, exec_ns=[start_ns, time.time_ns()])
            result = await asyncio.get_running_loop().run_in_executor(self.step_thread, self.execute, plan)
            return msgspec.structs.replace(result, epoch=self.epoch)
        except WorkerGroupError:
            raise  # on_failure ends the process: an answer would only say the step went wrong
        except InvalidPlan as exc:  # refused before anything ran: the executor is as it was
            log.warning("step plan refused", step_id=plan.step_id, error=str(exc))
            return StepResult(step_id=plan.step_id, epoch=self.epoch, error=f"the step plan was refused: {exc}")
        except Exception as exc:
            # answer anyway (the scheduler ends the step's requests) rather than leave it waiting forever
            log.exception("step failed", step_id=plan.step_id, req_ids=list(plan.num_scheduled_tokens))
            return StepResult(step_id=plan.step_id, epoch=self.epoch, error=f"the step failed: {type(exc).__name__}")
        finally:
            self.execute_seconds_total += time.perf_counter() - t0
            if self.recv_from_scheduler.get(zmq.EVENTS) & zmq.POLLIN:  # the next plan is here already
                self.num_steps_queued += 1

    async def admin_stats(self, args: dict) -> dict:
        stats = {**self.runner.stats(), "epoch": self.epoch, "num_steps": self.num_steps,
                 "num_steps_queued": self.num_steps_queued, "num_placeholder_tokens": self.num_placeholder_tokens,
                 "execute_seconds_total": self.execute_seconds_total, "startup": self.startup,
                 **(self.kv_role.stats() if self.kv_role is not None else {})}
        if hasattr(self.runner, "rank_reports"):  # a collective: on the step thread, between steps
            loop = asyncio.get_running_loop()
            stats["ranks"] = await loop.run_in_executor(self.step_thread, self.runner.rank_reports)
        return stats


    # ------------------------------------------------------------------ LoRA adapters
    def _lora(self):
        return getattr(self.runner, "lora", None)

    async def admin_lora_list(self, args: dict) -> dict:
        lora = self._lora()
        if lora is None:
            return {"enabled": False, "adapters": {}, "epoch": self.epoch}
        return {"enabled": True, "adapters": dict(lora.paths), "max_loras": lora.max_loras,
                "max_lora_rank": lora.max_lora_rank, "epoch": self.epoch}

    async def admin_lora_load(self, args: dict) -> dict:
        """Register the adapter at ``path`` as ``name``: ``{"loaded": name}``, or ``{"error", "status"}``
        (nothing changed)."""
        name, path = args.get("name"), args.get("path")
        refused = self._lora_refusal(name)
        if refused is not None:
            return refused
        if not path:
            return {"error": "lora_path is required", "status": 400}
        if name in self._lora().paths:
            return {"error": f"The lora adapter '{name}' has already been loaded.", "status": 400}
        from folio.core.executor.lora import LoRAError

        try:
            await asyncio.get_running_loop().run_in_executor(self.step_thread, self.runner.add_lora, name, str(path))
        except LoRAError as exc:
            return {"error": str(exc), "status": 400}
        log.info("LoRA adapter loaded", name=name, path=path)
        return {"loaded": name}

    async def admin_lora_unload(self, args: dict) -> dict:
        name = args.get("name")
        refused = self._lora_refusal(name)
        if refused is not None:
            return refused
        if name not in self._lora().paths:
            return {"error": f"The lora adapter '{name}' cannot be found.", "status": 404}
        await asyncio.get_running_loop().run_in_executor(self.step_thread, self.runner.remove_lora, name)
        log.info("LoRA adapter unloaded", name=name)
        return {"unloaded": name}

    def _lora_refusal(self, name) -> dict | None:
        if self._lora() is None:
            return {"error": "LoRA adapters are not enabled: start the server with --enable-lora", "status": 400}
        if not self.config.runtime.allow_runtime_lora:
            return {"error": "loading and unloading LoRA adapters at run time needs --allow-runtime-lora",
                    "status": 404}
        if not name or not isinstance(name, str):
            return {"error": "lora_name is required", "status": 400}
        return None


def _disk_tier_fields(runner) -> dict:
    """The disk tier's folder, layout id and cap for RegisterPool (the scheduler looks hashes up there)."""
    tiers = getattr(runner, "tiers", None)
    if tiers is None:
        return {}
    return {"kv_disk_dir": str(tiers.disk.root), "kv_layout_id": tiers.disk.layout,
            "kv_disk_bytes": tiers.disk.capacity_bytes}


def make_runner(config: ExecutorServiceConfig):
    """One ``ModelRunner``, or rank 0 of a tensor-parallel worker group."""
    size = config.runtime.tensor_parallel_size
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be 1 or more, got {size}")
    if size == 1:
        return ModelRunner(config.runtime, config.model_path)
    from folio.core.executor.runtime.workers import ParallelRunner

    return ParallelRunner(config.runtime, config.model_path)

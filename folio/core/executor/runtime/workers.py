"""The executor's tensor-parallel worker group (``--tensor-parallel-size N``).

The executor service's own process is rank 0: ``ParallelRunner`` starts ranks 1..N-1 (processes
with ``--distributed-executor-backend mp``, Ray actors in a placement group with ``ray``), they
all join one process group (gloo on the CPU, NCCL on GPUs) through rank 0's TCP store, and each
loads its shard. Per step rank 0 broadcasts one ``WorkerStep`` (the plan as it accepted it,
msgpack-encoded, plus the tokens it appended the step before), every rank runs the step on
its shard, and rank 0 samples and answers the scheduler. The service sees ``ParallelRunner`` as
it sees a ``ModelRunner``.

A plan that does not fit (``plan_check.py``) is refused on rank 0 before it is broadcast, so no
rank runs it. A rank that dies, a collective that fails, or a step that fails on any rank once
broadcast (the ranks could no longer be shown to agree, and one rank skipping a collective
would leave the others waiting) is an executor crash: the failing rank exits,
``on_failure`` is called (the service exits, so its supervisor restarts it under a new epoch and
the scheduler recomputes), and ``execute`` raises ``WorkerGroupError``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading
import time
from typing import Callable

import msgspec
import psutil
import structlog
import torch

from folio.core.executor.parallel.comm import Comm, Shard, check_shardable, connect, serve_store
from folio.core.executor.runtime.plan_check import InvalidPlan
from folio.core.executor.runtime.runner import ModelRunner, resolve_device
from folio.shared.config import RuntimeConfig
from folio.shared.messages import StepPlan, WorkerStep

log = structlog.get_logger()
BACKENDS = ("mp", "ray")
WATCH_EVERY_S = 0.5


class WorkerGroupError(RuntimeError):
    """A rank is gone or a collective failed: the group cannot run another step."""


def cpu_threads(size: int) -> int:
    """Each rank's share of the cores this process may use."""
    return max(1, len(os.sched_getaffinity(0)) // size)


def rank_device(config: RuntimeConfig, index: int) -> torch.device:
    """Rank ``index``'s device: the CPU, or the ``index``-th GPU (0 in a Ray actor, which sees
    only the GPU of its bundle)."""
    device = resolve_device(config.device)
    return torch.device("cuda", index) if device.type == "cuda" else device


class StepTimer:
    def __init__(self):
        self.num_steps, self.seconds_total, self.last_seconds = 0, 0.0, 0.0

    def add(self, seconds: float) -> None:
        self.num_steps += 1
        self.seconds_total += seconds
        self.last_seconds = seconds


def resident_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every distinct tensor a model keeps (parameters, buffers, packed weights held as plain
    attributes, the RoPE tables), each counted once."""
    seen: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for value in vars(mod).values():
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                seen.setdefault(id(value), value)
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            seen.setdefault(id(t), t)
    return list(seen.values())


def rank_report(runner: ModelRunner, timer: StepTimer) -> dict:
    """One rank's row of ``folio executor stats``: its device, resident weights, KV pool, process
    memory (bytes allocated on a GPU) and step times."""
    device = runner.device
    memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else psutil.Process().memory_info().rss
    weights = sum(t.numel() * t.element_size() for t in resident_tensors(runner.model))
    return {"rank": runner.shard.rank, "device": str(device), "weight_bytes": weights,
            "kv_pool_bytes": runner.pool.num_bytes, "num_kv_heads": runner.pool_shape.num_kv_heads,
            "host": socket.gethostname(), "memory_bytes": memory,
            "num_threads": torch.get_num_threads(), "num_steps": timer.num_steps,
            "step_seconds_total": round(timer.seconds_total, 6), "last_step_ms": round(timer.last_seconds * 1e3, 3)}


# --------------------------------------------------------------------------- ranks 1..N-1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_main(rank: int, size: int, host: str, port: int, config: RuntimeConfig, model_path: str,
                device_index: int, die_with_parent: bool = True) -> None:
    """A rank other than 0: join the group, load the shard, follow rank 0 until it says stop."""
    if die_with_parent:
        _die_with_parent()
    device = rank_device(config, device_index)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(size))
    comm = connect(rank, size, host, port, device)
    runner = ModelRunner(config, model_path, Shard(rank, size), comm, device)
    follow_loop(runner, comm)


def follow_loop(runner: ModelRunner, comm: Comm) -> None:
    decoder = msgspec.msgpack.Decoder(WorkerStep)
    timer = StepTimer()
    while True:
        message = decoder.decode(comm.broadcast_bytes(None))
        if message.command == "stop":
            return
        if message.command == "stats":
            comm.all_gather_bytes(msgspec.json.encode(rank_report(runner, timer)))
            continue
        t0 = time.perf_counter()
        try:
            runner.follow(message.plan, message.appended)
        except Exception:
            log.exception("step failed; this rank exits", rank=comm.rank, step_id=message.plan.step_id)
            raise
        timer.add(time.perf_counter() - t0)


# --------------------------------------------------------------------------- how ranks start


class MpWorkers:
    """Ranks 1..N-1 as child processes on this machine (spawned: no forked torch state)."""

    def __init__(self, size: int, config: RuntimeConfig):
        self.host = "127.0.0.1"
        self.procs = []

    def start(self, size: int, port: int, config: RuntimeConfig, model_path: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, size):
            proc = ctx.Process(target=worker_main, args=(rank, size, self.host, port, config, model_path, rank),
                               name=f"folio-tp-rank{rank}", daemon=True)
            proc.start()
            self.procs.append(proc)

    def dead(self) -> str | None:
        for rank, proc in enumerate(self.procs, 1):
            if proc.exitcode is not None:
                return f"rank {rank} exited with code {proc.exitcode}"
        return None

    def stop(self, timeout_s: float) -> None:
        for proc in self.procs:
            proc.join(timeout_s)
        self.abandon()

    def abandon(self) -> None:
        """End the ranks now."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


class RayWorkers:
    """Ranks 1..N-1 as Ray actors, one placement-group bundle each (a GPU, or a share of the
    cores), on the Ray cluster ``RAY_ADDRESS`` names, else on a local one started here."""

    def __init__(self, size: int, config: RuntimeConfig):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


        self.started_cluster = not ray.is_initialized()  # a local one, which must end with us
        if self.started_cluster:
            ray.init(ignore_reinit_error=True, log_to_driver=False)
        self.ray = ray
        gpu = resolve_device(config.device).type == "cuda"
        bundle = {"GPU": 1.0} if gpu else {"CPU": float(cpu_threads(size))}
        self.group = placement_group([bundle] * (size - 1), strategy="PACK")
        ray.get(self.group.ready(), timeout=300)
        options = {"num_gpus": 1.0, "num_cpus": 0} if gpu else {"num_cpus": bundle["CPU"]}
        self.actors = [
            ray.remote(RayWorker).options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=i)).remote()
            for i in range(size - 1)
        ]
        self.host = ray.util.get_node_ip_address()
        self.refs = []

    def start(self, size: int, port: int, config: RuntimeConfig, model_path: str) -> None:
        self.refs = [actor.run.remote(rank, size, self.host, port, config, model_path)
                     for rank, actor in enumerate(self.actors, 1)]

    def dead(self) -> str | None:
        ready, _ = self.ray.wait(self.refs, num_returns=1, timeout=0)
        if not ready:
            return None
        try:
            self.ray.get(ready[0])
        except Exception as exc:  # RayActorError and the like: the actor is gone
            return f"rank {self.refs.index(ready[0]) + 1}: {type(exc).__name__}: {str(exc)[:300]}"
        return f"rank {self.refs.index(ready[0]) + 1} returned"

    def stop(self, timeout_s: float) -> None:
        self.ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        self.abandon()

    def abandon(self) -> None:
        """End the actors now (and the local cluster this process started)."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.group)
        if self.started_cluster:
            self.ray.shutdown()


# --------------------------------------------------------------------------- rank 0


def _exit_now(reason: str) -> None:
    log.error("tensor-parallel worker group failed; the executor exits", reason=reason)
    os._exit(1)


class ParallelRunner:
    """Rank 0 of the group, in the executor service's process: a ``ModelRunner`` over its shard
    plus the other ranks. Attributes it does not define are its runner's (pool, spec, ...)."""

    def __init__(self, config: RuntimeConfig, model_path: str, on_failure: Callable[[str], None] = _exit_now):
        size = config.tensor_parallel_size
        if config.distributed_executor_backend not in BACKENDS:
            raise ValueError(f"unknown distributed executor backend {config.distributed_executor_backend!r}; "
                             f"choose {' or '.join(BACKENDS)}")
        _check_model(model_path, size)
        self.size, self.on_failure, self.closing, self.failed = size, on_failure, False, None
        launcher = MpWorkers if config.distributed_executor_backend == "mp" else RayWorkers
        self.workers = launcher(size, config)
        store, port = serve_store(self.workers.host, size)
        self.workers.start(size, port, config, model_path)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        device = rank_device(config, 0)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(size))
        self.comm = connect(0, size, self.workers.host, port, device, store=store)
        self.runner = ModelRunner(config, model_path, Shard(0, size), self.comm, device)
        self.encoder = msgspec.msgpack.Encoder()
        self.timer = StepTimer()

    def __getattr__(self, name: str):
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    def _watch(self) -> None:
        while not self.closing:
            reason = self.workers.dead()
            if reason is not None and not self.closing:
                self._fail(reason)
                return
            time.sleep(WATCH_EVERY_S)

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            try:  # the ranks left would wait in a collective forever
                self.workers.abandon()
            except Exception as exc:
                log.warning("ending the other ranks failed", error=str(exc))
            self.on_failure(reason)

    def _broadcast(self, message: WorkerStep) -> None:
        if self.failed is not None:
            raise WorkerGroupError(self.failed)
        try:
            self.comm.broadcast_bytes(self.encoder.encode(message))
        except RuntimeError as exc:
            self._fail(f"broadcast: {exc}")
            raise WorkerGroupError(str(exc)) from exc

    def execute(self, plan):
        try:  # refused on rank 0 before any rank runs it: the group stays whole
            plan = self.runner.accept(plan)
        except InvalidPlan:
            if plan.finished_req_ids:  # done whatever the rest said: every rank drops them
                self._broadcast(WorkerStep(plan=StepPlan(step_id=plan.step_id, finished_req_ids=plan.finished_req_ids),
                                           appended=self.runner.take_appended()))
            raise
        self._broadcast(WorkerStep(plan=plan, appended=self.runner.take_appended()))
        t0 = time.perf_counter()
        try:
            return self.runner.execute(plan)
        except Exception as exc:
            self._fail(f"step {plan.step_id}: {type(exc).__name__}: {exc}")
            raise WorkerGroupError(str(exc)) from exc
        finally:
            self.timer.add(time.perf_counter() - t0)

    def rank_reports(self) -> list[dict]:
        """Every rank's device, memory and step times (a collective: call it between steps)."""
        self._broadcast(WorkerStep(command="stats"))
        rows = self.comm.all_gather_bytes(msgspec.json.encode(rank_report(self.runner, self.timer)))
        return [msgspec.json.decode(row) for row in rows]

    def close(self, timeout_s: float = 10.0) -> None:
        if self.closing:
            return
        self.closing = True
        if self.failed is not None:
            return  # the ranks were ended when the group failed
        try:
            self.comm.broadcast_bytes(self.encoder.encode(WorkerStep(command="stop")))
        except RuntimeError:
            pass
        self.workers.stop(timeout_s)


def _check_model(model_path: str, size: int) -> None:
    """Refuse a model that does not split ``size`` ways before any rank starts."""
    from pathlib import Path

    from folio.core.executor.model.loader import load_hf_config
    from folio.core.executor.model.registry import check_runtime, model_spec

    if size < 2:
        raise ValueError(f"a worker group needs a tensor-parallel size of 2 or more, got {size}")
    spec = model_spec(load_hf_config(Path(model_path)))
    check_runtime(spec, tp_size=size)
    check_shardable(spec, Shard(0, size))


class RayWorker:
    """A rank of the tensor-parallel group as a Ray actor (``RayWorkers`` makes them, one per
    placement-group bundle): it runs ``worker_main`` until rank 0 says stop."""

    def run(self, rank: int, size: int, host: str, port: int, config, model_path: str) -> None:
        # the actor sees only its bundle's GPU (index 0); Ray ends actors whose owner is gone
        worker_main(rank, size, host, port, config, model_path, 0, die_with_parent=False)

"""The executor's part in disaggregated serving (``--kv-role``), around ``runner.execute``.

More in docs/modules.md (services/executor/kv_roles.py).
"""

from __future__ import annotations

import msgspec
import structlog
import torch

from folio.core.kv.tensors.pool import KVPool
from folio.core.kv.tensors.transfer import KVLayout, TransferError
from folio.services.executor.kv_sockets import KVReceiver, KVSender
from folio.core.kv.allocator import cdiv
from folio.shared.messages import TransferHandle
from folio.shared.messages import StepPlan, StepResult

log = structlog.get_logger()
MAX_STAGING_BLOCKS = 4096
STAGING_TTL_S = 300.0  # a transfer no decode instance pulled by then is freed (its pull is computed there)


def make_kv_role(runtime, runner):
    role = getattr(runtime, "kv_role", "both")
    if role == "prefill":
        return PrefillRole(runner, getattr(runtime, "kv_transfer_port", 0))
    if role == "decode":
        return DecodeRole(runner)
    return None


def _layout(runner) -> KVLayout:
    return KVLayout.of(runner.pool, getattr(runner, "kv_scales", None))


class PrefillRole:
    def __init__(self, runner, port: int = 0):
        self.runner = runner
        pool: KVPool = runner.pool
        self.staging = KVPool(pool.shape, min(pool.num_blocks, MAX_STAGING_BLOCKS), torch.device("cpu"))
        self.staging_free = list(range(self.staging.num_blocks))
        self.sender = KVSender(self.staging, _layout(runner), f"tcp://0.0.0.0:{port}" if port else "tcp://0.0.0.0:*",
                               on_release=self._released, ttl_s=STAGING_TTL_S)
        self.port = int(self.sender.endpoint.rsplit(":", 1)[1])
        self.tables: dict[str, tuple[list[int], int]] = {}  # req id -> (device block ids, prompt tokens)
        self.peers: dict[str, str] = {}  # req id -> the decode key its transfer is for (``kv_export_peer``)
        self.exported: set[str] = set()
        self.num_not_staged = 0
        log.info("kv role prefill: serving KV transfers", port=self.port)

    def _released(self, transfer_id: str, block_ids: list[int], ok: bool) -> None:
        self.staging_free.extend(block_ids)  # (called on the sender's thread; list ops are atomic)
        if not ok:
            log.info("kv transfer not confirmed: staged blocks freed", transfer_id=transfer_id)

    def execute(self, plan: StepPlan) -> StepResult:
        for r in plan.new_reqs:
            self.tables[r.req_id] = (list(r.block_ids), r.num_prompt_tokens)
            if r.kv_export_peer:
                self.peers[r.req_id] = r.kv_export_peer
        for r in plan.running_reqs:
            if r.req_id in self.tables:
                ids, n = self.tables[r.req_id]
                self.tables[r.req_id] = (list(r.block_ids) if r.block_ids is not None else ids + list(r.new_block_ids), n)
        result = self.runner.execute(plan)
        for req_id in result.req_ids:
            if req_id in self.tables and req_id not in self.exported:
                self._export(req_id)
        for req_id in plan.finished_req_ids:
            self.tables.pop(req_id, None)
            self.peers.pop(req_id, None)
            self.exported.discard(req_id)
        return result

    def _export(self, req_id: str) -> None:
        ids, num_prompt = self.tables[req_id]
        self.exported.add(req_id)
        n = cdiv(num_prompt, self.staging.block_size)
        if n > len(self.staging_free) or n > len(ids):
            self.num_not_staged += 1
            log.warning("kv transfer not staged: the staging pool is full", req_id=req_id, num_blocks=n)
            return
        staged = [self.staging_free.pop() for _ in range(n)]
        for src, dst in zip(ids[:n], staged):
            for s, d in zip(self.runner.pool.block_views(src), self.staging.block_views(dst)):
                d.copy_(s, non_blocking=False)
        self.sender.export(staged, num_tokens=num_prompt, transfer_id=req_id, peer=self.peers.get(req_id))

    def stats(self) -> dict:
        return {"kv_role": "prefill", "kv_transfer_port": self.port, "kv_block_size": self.staging.block_size,
                "kv_transfers": dict(self.sender.counts),
                "kv_transfers_outstanding": len(self.sender.outstanding), "kv_staging_blocks": self.staging.num_blocks,
                "kv_staging_free": len(self.staging_free), "kv_not_staged": self.num_not_staged}

    def close(self) -> None:
        self.sender.close()


class DecodeRole:
    def __init__(self, runner):
        self.runner = runner
        self.receiver = KVReceiver(runner.pool, _layout(runner))
        self.num_recomputed = 0

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.kv_loads:  # checked first: a pull writes into the blocks the plan names
            plan = self._load(self.runner.accept(plan))
        return self.runner.execute(plan)

    def _load(self, plan: StepPlan) -> StepPlan:
        failed = {}
        for load in plan.kv_loads:
            try:
                handle = TransferHandle.from_wire(load.handle)
                self.receiver.pull(handle, list(load.block_ids))
            except (TransferError, ValueError) as exc:
                log.warning("kv pull failed: computing the prompt here", req_id=load.req_id, error=str(exc))
                failed[load.req_id] = load.fallback_computed_tokens
        if not failed:
            return plan
        self.num_recomputed += len(failed)
        scheduled = dict(plan.num_scheduled_tokens)
        new_reqs = []
        for r in plan.new_reqs:
            if r.req_id in failed:
                start = failed[r.req_id]
                scheduled[r.req_id] += r.num_computed_tokens - start
                r = msgspec.structs.replace(r, num_computed_tokens=start)
            new_reqs.append(r)
        return msgspec.structs.replace(plan, new_reqs=new_reqs, num_scheduled_tokens=scheduled)

    def stats(self) -> dict:
        return {"kv_role": "decode", "kv_pulls": dict(self.receiver.counts), "kv_recomputed": self.num_recomputed}

    def close(self) -> None:
        pass

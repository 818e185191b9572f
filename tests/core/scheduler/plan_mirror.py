"""The executor's side of the plans in one process: what it holds for each request, built from the
plans alone (new requests in full, running ones as diffs), checked against the whole state the
scheduler planned with, step after step."""

from __future__ import annotations

from folio.shared.messages import StepPlan


class ExecutorMirror:
    """Per request: the computed tokens and the block table, as the executor keeps them. After
    each step it advances every scheduled request by its count, as the executor does."""

    def __init__(self):
        self.held: dict[str, tuple[int, list[int]]] = {}

    @staticmethod
    def full_state(out, alloc) -> dict[str, tuple[int, list[int]]]:
        """What the executor must hold for ``out``'s requests as the step starts (``schedule``
        advanced each one's computed tokens past its ``num_new`` of the step already)."""
        return {req.req_id: (req.num_computed_tokens - num_new, list(alloc.seqs[req.req_id].block_ids))
                for req, num_new in out.scheduled}

    def apply(self, plan: StepPlan) -> dict[str, tuple[int, list[int]]]:
        """Apply the plan's diffs; returns the state of its scheduled requests as the step starts."""
        held = self.held
        for req_id in plan.finished_req_ids:
            held.pop(req_id, None)
        for new in plan.new_reqs:
            assert new.req_id not in held, f"{new.req_id} sent in full while the executor holds it"
            held[new.req_id] = (new.num_computed_tokens, list(new.block_ids))
        for diff in plan.running_reqs:
            assert diff.req_id in held, f"a diff for {diff.req_id}, which the executor does not hold"
            table = list(diff.block_ids) if diff.block_ids is not None else held[diff.req_id][1]
            held[diff.req_id] = (diff.num_computed_tokens, table + diff.new_block_ids)
        missing = [req_id for req_id in plan.num_scheduled_tokens if req_id not in held]
        assert not missing, f"scheduled but never sent: {missing}"
        view = {req_id: (held[req_id][0], list(held[req_id][1])) for req_id in plan.num_scheduled_tokens}
        for req_id, n in plan.num_scheduled_tokens.items():
            held[req_id] = (held[req_id][0] + n, held[req_id][1])
        return view

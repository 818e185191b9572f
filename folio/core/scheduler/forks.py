"""The life cycles of forked requests, beside ``beam.py``: the choices of ``n`` > 1 and beam groups.

Several requests of one client request share blocks through forks (``KVFork``):

- with ``n`` > 1 the first choice computes all but the last prompt token, then the others are
  forked from it (``issue``) and each computes that last token itself and samples its own
  continuation (the shared, partly filled last block is copied on the first write). Until then the
  others wait in no queue (``Status.FORKING``, counted against ``max_num_seqs`` with their first);
  if the first goes away before, they start on their own (``orphan``);
- beam search keeps ``width`` beams in lockstep: once every live beam reported its top
  candidates (``report_beam``), ``beam.BeamSearch`` picks the next beams (``advance_beams``); a
  beam with several children is forked in the next step, one without any is freed, and when the
  search is over the group's choices get their results.

``Forks`` is part of the scheduler's state (``state.py``) and moves requests through its queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.core.scheduler.beam import BeamSearch
from folio.core.scheduler.request import Request, Status
from folio.shared.messages import EngineRequest, KVFork, TokenDelta
from folio.shared.sampling import SamplingParams


@dataclass(eq=False)
class BeamGroup:
    """One beam-search request: its live beams (requests), the choices that receive the best."""

    req_id: str
    choice_ids: list[str]
    search: BeamSearch
    sampling: SamplingParams  # what each beam runs with: greedy, top-2W logprobs
    live: dict[int, Request] = field(default_factory=dict)  # beam id -> request
    candidates: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    width: int = 1
    num_prompt_tokens: int = 0
    queue_time: float | None = None


class Forks:
    def __init__(self, sched):
        self.sched = sched  # the scheduler's state (``state.SchedulerState``): its queues and allocator replica
        self.unforked: list[Request] = []  # new beams, forked from their parent in the next step
        self.groups: dict[str, BeamGroup] = {}  # beam searches by each of their choice ids

    # ------------------------------------------------------------------ n > 1
    def defer(self, first: Request, others: list[Request]) -> None:
        """The other choices wait, in no queue, until ``first`` computed all but its last prompt token."""
        for req in others:
            req.status, req.fork_parent = Status.FORKING, first
        first.pending_forks = others

    def orphan(self, req: Request) -> None:
        """A first choice going away before its forks: the others start on their own."""
        for child in req.pending_forks:
            child.fork_parent = None
            self.sched.enqueue(self.sched.waiting, child, Status.WAITING)
        req.pending_forks = []

    def issue(self) -> None:
        """Fork the choices of first choices that computed all but their last prompt token, and
        the new beams of the last step. A child whose parent lost its table starts on its own."""
        sched = self.sched
        for req in list(sched.running):
            if req.pending_forks and req.num_computed_tokens == req.num_prompt_tokens - 1 and self._holds_table(req):
                for child in req.pending_forks:
                    self._fork(req, child)
                req.pending_forks = []
        unforked, self.unforked = self.unforked, []
        for child in unforked:
            parent = child.fork_parent
            if parent.status is Status.RUNNING and self._holds_table(parent):
                self._fork(parent, child)
            else:
                child.reset_for_recompute()
                sched.enqueue(sched.waiting, child, Status.WAITING)

    def _holds_table(self, req: Request) -> bool:
        seq = self.sched.alloc.seqs.get(req.req_id)
        return seq is not None and bool(seq.block_ids)

    def _fork(self, parent: Request, child: Request) -> None:
        sched = self.sched
        sched.kv.try_apply(KVFork(parent.req_id, child.req_id, parent.num_computed_tokens))
        child.fork_parent = None
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_kv_token_ids = parent.num_kv_token_ids
        child.admitted = True
        child.arrival_time, child.first_scheduled_time = parent.arrival_time, parent.first_scheduled_time
        sched.counters["num_forks"] += 1
        sched.enqueue(sched.running, child, Status.RUNNING)

    # ------------------------------------------------------------------ beam groups
    def add_beam_search(self, msg: EngineRequest, max_tokens: int, priority: int, arrival: int) -> None:
        params = msg.sampling
        eos = set(params.stop_token_ids)
        if msg.eos_token_id is not None and not params.ignore_eos:
            eos.add(msg.eos_token_id)
        width = params.num_sequences
        search = BeamSearch(width, length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                            max_tokens=max_tokens, eos_token_ids=eos)
        # every beam runs greedy and reports its top raw logprobs; the group picks its tokens
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=search.top_k)
        group = BeamGroup(req_id=msg.req_id, choice_ids=[msg.req_id, *msg.fork_req_ids], search=search,
                          sampling=sampling, width=width, num_prompt_tokens=len(msg.prompt_token_ids))
        beam = self._new_beam(group, search.beams[0].beam_id, msg.prompt_token_ids, [], (priority, arrival))
        beam.arrival_time = msg.arrival_time
        for choice_id in group.choice_ids:
            self.groups[choice_id] = group
        self.sched.enqueue(self.sched.waiting, beam, Status.WAITING)

    def _new_beam(self, group: BeamGroup, beam_id: int, prompt: list[int], output: list[int],
                  order: tuple[int, int]) -> Request:
        beam = Request(req_id=f"{group.req_id}#beam{beam_id}", prompt_token_ids=list(prompt), sampling=group.sampling,
                       max_tokens=group.search.max_tokens,
                       output_token_ids=list(output), append_sampled=False, group=group, key=(*order, beam_id))
        group.live[beam_id] = beam
        self.sched.requests[beam.req_id] = beam
        return beam

    def end_group(self, group: BeamGroup) -> None:
        sched = self.sched
        for beam in group.live.values():
            if beam.status is Status.FORKING:
                self.unforked.remove(beam)
                del sched.requests[beam.req_id]
            else:
                sched.dequeue(beam)
                sched.release(beam)
        group.live = {}
        for choice_id in group.choice_ids:
            self.groups.pop(choice_id, None)

    def report_beam(self, beam: Request, lp, groups: list[BeamGroup]) -> None:
        """A beam's top candidates; ``groups`` collects the groups whose every live beam reported."""
        group = beam.group
        beam_id = next(b for b, r in group.live.items() if r is beam)
        group.candidates[beam_id] = (lp.top_token_ids, lp.top_logprobs)
        if len(group.candidates) == len(group.live) and group not in groups:
            groups.append(group)

    def advance_beams(self, group: BeamGroup) -> list[TokenDelta]:
        """Every live beam reported: the search picks the next beams. A parent's first child goes
        on in its request, the others are forked from it in the next step; a parent without
        children is freed. Returns the choices' deltas once the search is over."""
        sched = self.sched
        decision = group.search.step(group.candidates)
        group.candidates = {}
        sched.counters["num_generation_tokens_total"] += len(group.live)
        if group.queue_time is None:
            group.queue_time = next(iter(group.live.values())).take_queue_time() or 0.0
        if group.search.done:
            self.end_group(group)
            sched.counters["num_requests_finished"] += len(group.choice_ids)
            results = group.search.results(len(group.choice_ids))
            return [TokenDelta(req_id=choice_id, token_ids=list(tokens), finish_reason=reason,
                               num_prompt_tokens=group.num_prompt_tokens,
                               queue_time_s=group.queue_time or None)
                    for choice_id, (tokens, _score, reason) in zip(group.choice_ids, results)]
        children: dict[int, list] = {}
        for beam in decision.beams:
            children.setdefault(beam.parent_beam_id, []).append(beam)
        old, group.live = group.live, {}
        for parent_id, parent in old.items():
            kids = children.get(parent_id, [])
            if not kids:
                sched.dequeue(parent)
                sched.release(parent)
                continue
            base = list(parent.output_token_ids)
            for n, kid in enumerate(kids):
                token = kid.output_token_ids[-1]
                if n == 0:
                    parent.output_token_ids.append(token)
                    parent.unsent_token_ids.append(token)
                    group.live[kid.beam_id] = parent
                    continue
                child = self._new_beam(group, kid.beam_id, parent.prompt_token_ids, base + [token], parent.key[:2])
                child.status, child.fork_parent = Status.FORKING, parent
                self.unforked.append(child)
        return []

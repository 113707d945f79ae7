"""How requests end other than by finishing: failed steps, the caller's aborts, requests that never start.
Each frees exactly what the request holds and reports it finished with reason abort, once.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import torch

from engine.beam_search import stage as beam_stage
from engine.ipc.messages import BatchTokenOut, FinishReason, NO_TOKEN, STOP_STRING_MATCHED
from engine.scheduler.finish import abort_held, finished_hook, request_meta
from engine.scheduler.request import Req
from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState


def schedule_failed(state: SchedulerState, message: str) -> None:
    """schedule() raised (a bug, or a plugin's hook): fail the requests it was working on. A prefill
    plan fails the requests it had admitted (they hold slots); a failure before any was admitted
    fails the waiting queue, which would otherwise fail the same way every turn; a decode step
    fails the running batch, whose tensors may be half-updated. Requests admission had already failed
    this turn (and left in the queue until its end) are not failed again."""
    traceback.print_exc()
    planned = state.plan.take_planned()
    if state.plan.phase is ForwardMode.DECODE or not (planned or state.waiting):
        rows = state.running
        abort_reqs(state, rows.reqs, rows.kv_lens.tolist(), message)
        rows.clear()
        beam_stage.abort(state, list(state.beams.groups), message, keep_kv=False)
        return
    state.waiting.take(lambda r: r.finished is not None)
    state.plan.drop_chunk(planned)
    if planned:
        state.waiting.remove(planned)
        abort_reqs(state, planned, [r.kv_len for r in planned], message)
        return
    for req in state.waiting.take(lambda r: True):
        if req.slot is None:
            finish_unstarted(state, req, message)
        else:
            abort_reqs(state, [req], [req.kv_len], message)


def abort_step(state: SchedulerState, step: Step, message: str) -> None:
    """A step raised: fail every request in it, free their memory (not cached: it may be garbage)."""
    if step.mode is ForwardMode.DECODE:
        rows = step.rows
        abort_reqs(state, rows.reqs, rows.kv_lens.tolist(), message)
        state.running.clear()
        beam_stage.abort(state, list(state.beams.groups), message, keep_kv=False)
    else:
        reqs = step.extend_reqs
        state.plan.drop_chunk(reqs)
        abort_reqs(state, reqs, [r.kv_len for r in reqs], message)


def abort_reqs(
    state: SchedulerState, reqs: list[Req], kv_lens: list[int], message: str, keep_kv: bool = False
) -> None:
    # a step that failed after some of its requests finished must not free or report those twice
    live = [(r, k) for r, k in zip(reqs, kv_lens) if r.finished is None and r.slot is not None]
    # beam searches under way end with their beams
    searching = {id(g.req): g for g in state.beams.groups}
    if searching and any(id(r) in searching for r, _ in live):
        beam_stage.abort(
            state, [searching[id(r)] for r, _ in live if id(r) in searching], message, keep_kv
        )
        live = [(r, k) for r, k in live if id(r) not in searching]
    abort_held(state, [r for r, _ in live], [k for _, k in live], message, keep_kv)


def abort_rids(state: SchedulerState, targets: dict[str, set[int] | None], message: str) -> None:
    """The caller's abort (or the detokenizer's stop string): drop the requests wherever they are,
    keep their valid K/V in the cache, report them finished with reason abort. `targets`: rids, or
    rid -> the seqs meant (None: any)."""

    def meant(r: Req) -> bool:
        if r.rid not in targets:
            return False
        seqs = targets[r.rid]
        return seqs is None or r.seq in seqs

    gone: list[tuple[Req, int]] = [(r, 0) for r in state.waiting.take(meant)]
    req = state.plan.chunked
    if req is not None and meant(req):
        state.plan.chunked = None
        gone.append((req, req.kv_len))
    rows = state.running
    hit = [meant(r) for r in rows.reqs]
    if any(hit):
        kv_lens = rows.kv_lens.tolist()
        gone += [(r, kv_len) for r, kv_len, h in zip(rows.reqs, kv_lens, hit) if h]
        keep = [not h for h in hit]
        rows.filter(torch.tensor(keep, device=state.device), keep)
    groups = [g for g in state.beams.groups if meant(g.req)]
    if groups:
        beam_stage.abort(state, groups, message)
    if not gone:
        return
    reason = FinishReason("abort", message=message)
    stopped = message == STOP_STRING_MATCHED  # a normal finish the detokenizer saw first
    for req, kv_len in gone:
        req.finished = FinishReason("stop", message=message) if stopped else reason
        if req.slot is not None:
            state.kv.free_request(req, kv_len)
        finished_hook(req)
    n = len(gone)
    out = BatchTokenOut(
        [r.rid for r, _ in gone], [NO_TOKEN] * n, [reason] * n, [request_meta(r) for r, _ in gone]
    )
    state.outbox.send(out)
    # a stop string is a normal finish that the detokenizer saw first
    state.counters[
        "finished_requests" if message == STOP_STRING_MATCHED else "aborted_requests"
    ] += n


def finish_unstarted(state: SchedulerState, req: Req, message: str) -> None:
    """Fail a request that never got memory (it holds none)."""
    reason = req.finished = FinishReason("abort", message=message)
    out = BatchTokenOut([req.rid], [NO_TOKEN], [reason], [request_meta(req)])
    state.outbox.send(out)
    state.counters["aborted_requests"] += 1
    finished_hook(req)

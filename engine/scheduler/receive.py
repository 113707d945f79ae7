"""The receive stage: drain the request socket, check each arrival, queue it or answer it.

A message that cannot be handled is reported and dropped; it never stops the loop.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import TYPE_CHECKING

from engine import hooks
from engine.beam_search import stage as beam_stage
from engine.hooks import HookError
from engine.ipc.inbox import Inbox
from engine.ipc.messages import (
    AbortRequest,
    BatchTokenOut,
    FinishReason,
    FlushCache,
    GenerateBatch,
    NO_TOKEN,
    RequestMeta,
    StatsRequest,
    ToScheduler,
    TokenizedRequest,
)
from engine.grammar.stage import constraint_of
from engine.scheduler.admission import check_request, clip_to_context
from engine.scheduler.endings import abort_rids, finish_unstarted
from engine.scheduler.request import Req
from engine.scheduler.stats import stats
from engine.taps.request import RequestTaps

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)
SUPERSEDED = "superseded: a new request reused this rid"


def recv_requests(state: SchedulerState, inbox: Inbox, block: bool) -> None:
    """Drain the request socket; when nothing runs, block on it (no spinning on an idle machine).
    A message that cannot be handled is reported and dropped: it never stops the loop."""
    if block:
        inbox.sock.poll(timeout=None)
    for message in inbox.drain():
        try:
            handle(state, message)
        except Exception as exc:  # noqa: BLE001 - one message must not take the process down
            logger.error(
                "engine::scheduler: dropped a %s message that failed (%s: %s)",
                type(message).__name__,
                type(exc).__name__,
                exc,
            )


def handle(state: SchedulerState, message: ToScheduler) -> None:
    if isinstance(message, GenerateBatch):
        admit_arrivals(state, message.reqs)
    elif isinstance(message, AbortRequest):
        abort_rids(state, abort_targets(message), message.message)
    elif isinstance(message, StatsRequest):
        state.outbox.send(stats(state, message.req_id))
    elif isinstance(message, FlushCache):
        flushed = state.kv.cache.flush()
        state.outbox.send(stats(state, message.req_id, flushed))


def admit_arrivals(state: SchedulerState, arrivals: list[TokenizedRequest]) -> None:
    """Queue each request that passes the arrival checks; answer the others with an abort naming the
    field at fault (each fails alone)."""
    eos = state.eos_ids
    now = time.time_ns()
    vocab = state.vocab_size
    live = state.live_rids()
    arrived_hook = hooks.has("engine_request_arrived")
    constrained = False
    for r in arrivals:
        if r.rid in live:  # reused: the user process only reuses a rid whose request it saw finish,
            # here by a stop string whose abort is still on its way from the detokenizer; ended first,
            # even if the new one is refused, or it would run on under a rid nobody reads
            abort_rids(state, {r.rid: {live.pop(r.rid)}}, SUPERSEDED)
        problem = arrival_problem(state, r, vocab)
        if problem is None:
            try:
                req = new_req(state, r, eos, now)
            except Exception as exc:  # noqa: BLE001 - as in arrival_problem: this request alone
                problem = f"the request could not be queued: {type(exc).__name__}: {exc}"
        if problem is not None:
            refuse(state, r, problem)
            continue
        if arrived_hook:
            try:
                hooks.call("engine_request_arrived", req=req)
            except HookError as exc:  # this request fails alone, before it waits
                finish_unstarted(state, req, str(exc))
                continue
        try:
            constraint = constraint_of(r.sampling)
            # compiled off the loop; the request waits for it, the others do not
            if constraint is not None:
                req.grammar = state.grammars.request(*constraint)
                constrained = True
                if state.config.tp_size > 1:  # ready on every rank in the same turn, or they part
                    futures.wait([req.grammar])
        except Exception as exc:  # noqa: BLE001 - this request alone
            finish_unstarted(state, req, f"{type(exc).__name__}: {exc}")
            continue
        state.waiting.add(req)
        live[r.rid] = r.seq
    if constrained:  # compiles queued for requests gone meanwhile would run before these
        state.grammars.sweep(state.waiting.reqs)


def arrival_problem(state: SchedulerState, r: TokenizedRequest, vocab: int) -> str | None:
    """Why this arrival cannot be queued, or None. A check that raises refuses this request alone: an
    exception escaping here would drop the rest of its GenerateBatch, whose callers would wait forever."""
    try:
        problem = check_request(r, vocab, state.context_len)
        if problem is None and r.beam is not None:
            problem = beam_stage.arrival_problem(state, r)
        return problem
    except Exception as exc:  # noqa: BLE001 - one request's failure is not its neighbours'
        return f"the arrival checks failed: {type(exc).__name__}: {exc}"


def new_req(state: SchedulerState, r: TokenizedRequest, eos: tuple[int, ...], now: int) -> Req:
    """The scheduler's request for an arrival that passed the checks."""
    r = clip_to_context(r, state.context_len)  # the user process does this too; be safe
    req = Req(
        r.rid,
        r.input_ids,
        r.sampling,
        eos,
        r.return_logprob,
        r.top_logprobs_num,
        r.logprob_start_len,
        r.trace_context,
        r.submitted_ns or now,
        now,
        r.seq,
        r.beam,
    )
    if r.layers is not None:
        req.taps = RequestTaps(r.layers, len(r.input_ids), r.sampling.max_new_tokens, state.taps)
        state.taps.requested = True
    return req


def refuse(state: SchedulerState, r: TokenizedRequest, problem: str) -> None:
    """Answer a request that failed the arrival checks: finished, reason abort, nothing queued."""
    reason = FinishReason("abort", message=f"invalid request: {problem}")
    out = BatchTokenOut([r.rid], [NO_TOKEN], [reason], [RequestMeta(len(r.input_ids), 0, 0)])
    state.outbox.send(out)
    state.counters["aborted_requests"] += 1


def abort_targets(message: AbortRequest) -> dict[str, set[int] | None]:
    """rid -> the submission numbers an abort means (None: any; 0 or no seqs given means any)."""
    targets: dict[str, set[int] | None] = {}
    seqs = message.seqs if len(message.seqs) == len(message.rids) else [0] * len(message.rids)
    for rid, seq in zip(message.rids, seqs):
        if seq == 0 or (rid in targets and targets[rid] is None):
            targets[rid] = None
        else:
            targets.setdefault(rid, set()).add(seq)
    return targets

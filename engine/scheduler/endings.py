"""How requests end other than by finishing: failed steps, the caller's aborts, requests that never start.
Each frees exactly what the request holds and reports it finished with reason abort, once.
"""

from __future__ import annotations

import logging
import traceback
from typing import TYPE_CHECKING

import torch

from engine import hooks
from engine.beam_search import stage as beam_stage
from engine.hooks import HookError
from engine.ipc.messages import (
    BatchTokenOut,
    FinishReason,
    NO_TOKEN,
    RequestMeta,
    STOP_STRING_MATCHED,
)
from engine.scheduler.batch import RunningBatch
from engine.scheduler.request import Req
from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def schedule_failed(sched: Scheduler, message: str) -> None:
    """schedule() raised (a bug, or a plugin's hook): fail the requests it was working on. A prefill
    plan fails the requests it had admitted (they hold slots); a failure before any was admitted
    fails the waiting queue, which would otherwise fail the same way every turn; a decode step
    fails the running batch, whose tensors may be half-updated. Requests admission had already failed
    this turn (and left in the queue until its end) are not failed again."""
    traceback.print_exc()
    planned, sched._planned = sched._planned, []
    if sched._phase is ForwardMode.DECODE or not (planned or sched.waiting):
        rows = sched.running
        abort_reqs(sched, rows.reqs, rows.kv_lens.tolist(), message)
        sched.running = RunningBatch.empty(sched.model_config.vocab_size, sched.device)
        beam_stage.abort(sched, list(sched.beams.groups), message, keep_kv=False)
        return
    sched.waiting = [r for r in sched.waiting if r.finished is None]
    if sched.chunked_req is not None and any(r is sched.chunked_req for r in planned):
        sched.chunked_req = None
    if planned:
        ids = {id(r) for r in planned}
        sched.waiting = [r for r in sched.waiting if id(r) not in ids]
        abort_reqs(sched, planned, [r.kv_len for r in planned], message)
        return
    waiting, sched.waiting = sched.waiting, []
    for req in waiting:
        if req.slot is None:
            finish_unstarted(sched, req, message)
        else:
            abort_reqs(sched, [req], [req.kv_len], message)


def abort_step(sched: Scheduler, step: Step, message: str) -> None:
    """A step raised: fail every request in it, free their memory (not cached: it may be garbage)."""
    if step.mode is ForwardMode.DECODE:
        rows = step.rows
        abort_reqs(sched, rows.reqs, rows.kv_lens.tolist(), message)
        sched.running = RunningBatch.empty(sched.model_config.vocab_size, sched.device)
        beam_stage.abort(sched, list(sched.beams.groups), message, keep_kv=False)
    else:
        reqs = step.extend_reqs
        if sched.chunked_req is not None and any(r is sched.chunked_req for r in reqs):
            sched.chunked_req = None
        abort_reqs(sched, reqs, [r.kv_len for r in reqs], message)


def abort_reqs(
    sched: Scheduler, reqs: list[Req], kv_lens: list[int], message: str, keep_kv: bool = False
) -> None:
    # a step that failed after some of its requests finished must not free or report those twice
    live = [(r, k) for r, k in zip(reqs, kv_lens) if r.finished is None and r.slot is not None]
    searching = {
        id(g.req): g for g in sched.beams.groups
    }  # beam searches under way end with their beams
    if searching and any(id(r) in searching for r, _ in live):
        beam_stage.abort(
            sched, [searching[id(r)] for r, _ in live if id(r) in searching], message, keep_kv
        )
        live = [(r, k) for r, k in live if id(r) not in searching]
    if not live:
        return
    reqs, kv_lens = [r for r, _ in live], [k for _, k in live]
    reason = FinishReason("abort", message=message)
    meta = []
    for req, kv_len in zip(reqs, kv_lens):
        req.finished = reason
        meta.append(request_meta(req))
        sched.kv.free_request(req, kv_len, keep=keep_kv)
        finished_hook(req)
    n = len(reqs)
    out = BatchTokenOut([r.rid for r in reqs], [NO_TOKEN] * n, [reason] * n, meta)
    sched.send_sock.send(sched.send_codec.encode(out))
    sched.counters["aborted_requests"] += n


def abort_rids(sched: Scheduler, targets: dict[str, set[int] | None], message: str) -> None:
    """The caller's abort (or the detokenizer's stop string): drop the requests wherever they are,
    keep their valid K/V in the cache, report them finished with reason abort. `targets`: rids, or
    rid -> the seqs meant (None: any)."""

    def meant(r: Req) -> bool:
        if r.rid not in targets:
            return False
        seqs = targets[r.rid]
        return seqs is None or r.seq in seqs

    gone: list[tuple[Req, int]] = [(r, 0) for r in sched.waiting if meant(r)]
    if gone:
        sched.waiting = [r for r in sched.waiting if not meant(r)]
    req = sched.chunked_req
    if req is not None and meant(req):
        sched.chunked_req = None
        gone.append((req, req.kv_len))
    rows = sched.running
    hit = [meant(r) for r in rows.reqs]
    if any(hit):
        kv_lens = rows.kv_lens.tolist()
        gone += [(r, kv_len) for r, kv_len, h in zip(rows.reqs, kv_lens, hit) if h]
        keep = [not h for h in hit]
        rows.filter(torch.tensor(keep, device=sched.device), keep)
    groups = [g for g in sched.beams.groups if meant(g.req)]
    if groups:
        beam_stage.abort(sched, groups, message)
    if not gone:
        return
    reason = FinishReason("abort", message=message)
    stopped = message == STOP_STRING_MATCHED  # a normal finish the detokenizer saw first
    for req, kv_len in gone:
        req.finished = FinishReason("stop", message=message) if stopped else reason
        if req.slot is not None:
            sched.kv.free_request(req, kv_len)
        finished_hook(req)
    n = len(gone)
    out = BatchTokenOut(
        [r.rid for r, _ in gone], [NO_TOKEN] * n, [reason] * n, [request_meta(r) for r, _ in gone]
    )
    sched.send_sock.send(sched.send_codec.encode(out))
    # a stop string is a normal finish that the detokenizer saw first
    sched.counters[
        "finished_requests" if message == STOP_STRING_MATCHED else "aborted_requests"
    ] += n


def finish_unstarted(sched: Scheduler, req: Req, message: str) -> None:
    """Fail a request that never got memory (it holds none)."""
    reason = req.finished = FinishReason("abort", message=message)
    out = BatchTokenOut([req.rid], [NO_TOKEN], [reason], [request_meta(req)])
    sched.send_sock.send(sched.send_codec.encode(out))
    sched.counters["aborted_requests"] += 1
    finished_hook(req)


def finished_hook(req: Req) -> None:
    if hooks.has("engine_request_finished"):
        try:
            hooks.call("engine_request_finished", req=req, finish_reason=req.finished.to_dict())
        except HookError as exc:  # the request is over: report, nothing to fail
            logger.error("engine::scheduler: %s", exc)


def request_meta(req: Req) -> RequestMeta:
    return RequestMeta(req.prompt_len, len(req.output_ids), req.cached_tokens)

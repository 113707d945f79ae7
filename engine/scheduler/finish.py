"""Telling that a request ended: plugins (engine_request_finished), its usage figures, and the abort
of requests that hold memory (for every stage that fails requests, beam search's included)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine import hooks
from engine.hooks import HookError
from engine.ipc.messages import BatchTokenOut, FinishReason, NO_TOKEN, RequestMeta
from engine.scheduler.request import Req

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)


def finished_hook(req: Req) -> None:
    if hooks.has("engine_request_finished"):
        try:
            hooks.call("engine_request_finished", req=req, finish_reason=req.finished.to_dict())
        except HookError as exc:  # the request is over: report, nothing to fail
            logger.error("engine::scheduler: %s", exc)


def request_meta(req: Req) -> RequestMeta:
    """A request's last output's counters, and its hidden states when it asked for them."""
    meta = RequestMeta(req.prompt_len, len(req.output_ids), req.cached_tokens)
    taps = req.taps
    if taps is not None and taps.hidden is not None:
        meta.hidden_states = taps.result(len(req.output_ids))
    return meta


def abort_held(
    state: SchedulerState, reqs: list[Req], kv_lens: list[int], message: str, keep_kv: bool
) -> None:
    """Requests that hold a slot (not beam searches under way) end with reason abort: memory freed,
    reported once (those already finished or holding nothing are skipped)."""
    live = [(r, k) for r, k in zip(reqs, kv_lens) if r.finished is None and r.slot is not None]
    if not live:
        return
    reason = FinishReason("abort", message=message)
    meta = []
    for req, kv_len in live:
        req.finished = reason
        meta.append(request_meta(req))
        state.kv.free_request(req, kv_len, keep=keep_kv)
        finished_hook(req)
    n = len(live)
    state.outbox.send(BatchTokenOut([r.rid for r, _ in live], [NO_TOKEN] * n, [reason] * n, meta))
    state.counters["aborted_requests"] += n

"""Memory pressure: when a decode step finds the pool short, the radix cache gives up unlocked entries
first; then the most recently admitted requests are retracted to the waiting queue, their K/V kept in
the cache where it survives, and resume later from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.beam_search import stage as beam_stage
from engine.scheduler.endings import abort_reqs
from engine.scheduler.request import Req

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState

RETRACT_HEADROOM_STEPS = 4  # after a retraction, room for this many decode steps of what remains


def make_room_for_decode(state: SchedulerState) -> bool:
    """Ensure one pool token per decode row: evict cache, then retract the most recently admitted
    requests (a prompt part-way through chunked prefill first, beam searches last: they start over).
    Returns False when nothing is left to decode."""
    kv = state.kv
    rows, beams = state.running, state.beams

    def need() -> int:
        return len(rows) + beams.num_rows

    if kv.headroom >= need():
        return True
    retracted: list[Req] = []
    try:
        while kv.headroom < need() * RETRACT_HEADROOM_STEPS and (
            state.plan.chunked is not None or len(rows) + len(beams.groups) > 1
        ):
            if state.plan.chunked is not None:
                req = state.plan.chunked
                kv_len, state.plan.chunked = req.kv_len, None
            elif not len(rows):
                # a search starts over if retracted: only when the next step cannot run
                if kv.headroom >= need():
                    break
                retracted.append(beam_stage.retract_last(state))
                continue
            else:
                req, kv_len = rows.reqs[-1], int(rows.kv_lens[-1])
                keep = [True] * (len(rows) - 1) + [False]
                rows.filter(torch.tensor(keep, device=state.device), keep)
            # first, ready to resume: out of the batch, it must reach the queue whatever happens next
            retracted.append(req)
            req.fill_ids = req.all_ids()
            if not req.header_sent:  # a chunked prefill redone from the cache recomputes these
                req.reset_prompt_logprobs()
            # its K/V stays in the tree, evictable, for when it resumes
            kv.free_request(req, kv_len)
    finally:  # also when freeing one raised (the step then fails): every request taken out is queued again
        if retracted:
            state.waiting.requeue(retracted[::-1])
            state.counters["retracted_requests"] += len(retracted)
            state.plan.retracted()
    if kv.headroom >= need():
        return True
    # one request left and the pool cannot hold its next token (the user process refuses requests
    # that could get here, so this guards a mis-sized pool)
    if beams:
        beam_stage.abort(
            state,
            list(beams.groups),
            f"KV pool exhausted (max_total_tokens={state.max_total_tokens})",
        )
        return False
    kv_len = int(rows.kv_lens[0])
    message = f"KV pool exhausted at {kv_len} tokens (max_total_tokens={state.max_total_tokens})"
    abort_reqs(state, rows.reqs, [kv_len], message, keep_kv=True)
    state.running.clear()
    return False

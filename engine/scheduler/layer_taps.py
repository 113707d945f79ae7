"""The layer-taps stage: lay out each step's rows for the taps its requests asked for (before the
forward pass), hand over the captured rows (after it), and fail the requests a plugin tap failed on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.forward_batch import ForwardMode
from engine.scheduler.endings import abort_rids
from engine.taps.plan import Segment, TapPlan

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState
    from engine.scheduler.step import Step


def attach(state: SchedulerState, step: Step) -> None:
    """Give the step's ForwardBatch its TapPlan, or leave it None: no request in the step taps
    anything and no plugin taps every request (then the forward pass is the untapped one)."""
    registry = state.taps
    if not registry.active:
        return
    every = registry.every_request()
    batch = step.forward_batch
    if batch.mode is ForwardMode.EXTEND:
        reqs = step.extend_reqs
        if not every and all(r.taps is None for r in reqs):
            return
        segments, row = [], 0
        for req, prefix, take in zip(reqs, batch.prefix_lens, batch.extend_lens):
            segments.append(Segment(req.rid, req.taps, row, prefix, take))
            row += take
        mode = "prefill"
    else:
        ordinary, beam_reqs = step.rows.reqs, step.beam_reqs
        if not every and all(r.taps is None for r in ordinary + beam_reqs):
            return
        positions = batch.positions.tolist()
        beams = [None] * len(ordinary) + list(state.beams.beam_index)
        segments = [
            Segment(r.rid, r.taps, i, positions[i], 1, beams[i])
            for i, r in enumerate(ordinary + beam_reqs)
        ]
        mode = "decode"
    plan = TapPlan(mode, registry.model)
    for seg in segments:
        plan.add(seg, every)
    if mode == "decode":
        _beam_rows(state, plan, len(step.rows.reqs))
    batch.taps = plan.finalize(state.device)


def _beam_rows(state: SchedulerState, plan: TapPlan, row: int) -> None:
    """The rows of each beam search that keeps its beams' hidden states (they follow the ordinary
    rows, in group order, one per beam)."""
    for g in state.beams.groups:
        if g.hidden is not None:
            plan.add_beam_rows(g.req.taps, row, g.width)
        row += g.width


def deliver(step: Step) -> None:
    """After the forward pass: each request's captured rows join its hidden states."""
    plan = step.forward_batch.taps
    if plan is not None:
        plan.deliver()


def failed(step: Step) -> dict[str, str]:
    """rid -> why a plugin tap failed on its rows this step: the sample stage ends the rows that
    sample (ordinary rows and beam searches) without a token."""
    plan = step.forward_batch.taps
    return plan.failed if plan is not None else {}


def fail_tapped(state: SchedulerState, step: Step) -> None:
    """After the step's results: a prompt chunk that sampled nothing yet, whose rows a plugin tap
    failed on, ends with its error too."""
    plan = step.forward_batch.taps
    if plan is None or not plan.failed:
        return
    by_message: dict[str, dict[str, set[int]]] = {}
    for req in step.extend_reqs:
        message = plan.failed.get(req.rid)
        if message is not None and req.finished is None:
            by_message.setdefault(message, {})[req.rid] = {req.seq}
    for message, targets in by_message.items():
        abort_rids(state, targets, message)

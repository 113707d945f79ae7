"""The schedule stage: choose the next step, a prefill of waiting requests or a decode of the running ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduler.decode import decode_step
from engine.scheduler.memory_pressure import make_room_for_decode
from engine.scheduler.prefill import plan_prefill, prefill_step
from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState


def schedule(state: SchedulerState) -> Step | None:
    """A prefill step if anything can be admitted, else a decode step of the running batch. While a
    chunked prefill is in progress, decode steps alternate with its chunks."""
    plan = state.plan
    plan.begin()
    running = len(state.running) > 0 or bool(state.beams)
    interleave = plan.chunked is not None and running and plan.last_mode is ForwardMode.EXTEND
    if not interleave:
        entries = plan_prefill(state)
        step = prefill_step(state, entries) if entries else None
        if step is not None:
            plan.last_mode = ForwardMode.EXTEND
            return step
    plan.begin_decode()
    if running and make_room_for_decode(state):
        plan.last_mode = ForwardMode.DECODE
        return decode_step(state)
    plan.last_mode = None
    return None

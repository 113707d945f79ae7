"""The schedule stage: choose the next step, a prefill of waiting requests or a decode of the running ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.scheduler.decode import decode_step
from engine.scheduler.memory_pressure import make_room_for_decode
from engine.scheduler.prefill import plan_prefill, prefill_step
from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler


def schedule(sched: Scheduler) -> Step | None:
    """A prefill step if anything can be admitted, else a decode step of the running batch. While a
    chunked prefill is in progress, decode steps alternate with its chunks."""
    sched._planned = []
    sched._phase = ForwardMode.EXTEND
    running = len(sched.running) > 0 or bool(sched.beams)
    interleave = sched.chunked_req is not None and running and sched.last_mode is ForwardMode.EXTEND
    if not interleave:
        entries = plan_prefill(sched)
        step = prefill_step(sched, entries) if entries else None
        if step is not None:
            sched.last_mode = ForwardMode.EXTEND
            return step
    sched._phase = ForwardMode.DECODE
    if running and make_room_for_decode(sched):
        sched.last_mode = ForwardMode.DECODE
        return decode_step(sched)
    sched.last_mode = None
    return None

"""One scheduled step: what the schedule stage hands to forward, sample and process results."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine import hooks
from engine.hooks import HookError
from engine.hooks.types import StepRecord
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.scheduler.batch import RunningBatch
from engine.scheduler.request import Req

logger = logging.getLogger(__name__)


@dataclass
class Step:
    """The forward inputs plus the rows (with their sampling tensors) the step serves."""

    forward_batch: ForwardBatch
    rows: RunningBatch  # DECODE: the running batch itself; EXTEND: requests whose prefill completes
    # EXTEND: every request in the step, chunks too
    extend_reqs: list[Req] = field(default_factory=list)
    # EXTEND: prompt logprob rows after the next-token rows: (request, first extra row, rows, first position)
    prompt_logprobs: list[tuple[Req, int, int, int]] = field(default_factory=list)
    # beam searches (engine/beam_search): their rows follow the ordinary rows in the logits. EXTEND:
    # searches whose prompt completes (one row each); DECODE: every live beam, its request row by row
    beam_starts: list[Req] = field(default_factory=list)
    beam_reqs: list[Req] = field(default_factory=list)
    beam_out: list | None = None  # the sample stage's selections, for process results
    # id(req) -> why its search fails alone (a custom processor, its grammar backend or its selection raised)
    beam_failed: dict[int, str] = field(default_factory=dict)

    @property
    def mode(self) -> ForwardMode:
        return self.forward_batch.mode

    @property
    def rids(self) -> list[str]:
        """Every request in the step (for EXTEND, chunks that produce no token yet included)."""
        if self.extend_reqs:
            return [r.rid for r in self.extend_reqs]
        return self.rows.rids + [r.rid for r in self.beam_reqs]

    @property
    def reqs(self) -> list[Req]:
        """Every request the step serves, once each (a beam search once, not once per beam)."""
        if self.extend_reqs:
            return self.extend_reqs
        return self.rows.reqs + list({id(r): r for r in self.beam_reqs}.values())


def step_end_hook(step: Step, reqs: list[Req], times: tuple, error: str | None) -> None:
    """engine_step_end with wall-clock times: the loop's perf_counter marks, anchored once."""
    wall, perf = time.time_ns(), time.perf_counter()
    t0, t1, t2, t3, t4 = (None if t is None else wall - int((perf - t) * 1e9) for t in times)
    mode = "prefill" if step.mode is ForwardMode.EXTEND else "decode"
    record = StepRecord(
        mode, reqs, int(step.forward_batch.input_ids.numel()), t0, t1, t2, t3, t4, error
    )
    try:
        hooks.call("engine_step_end", step=record)
    except HookError as exc:  # the step is over: report, nothing to fail
        logger.error("engine::scheduler: %s", exc)

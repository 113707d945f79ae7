"""Running a step: the model's forward pass, then the sample stage (prompt logprobs, then one token per row)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine import hooks
from engine.beam_search import stage as beam_stage
from engine.sampling.sampler import SampleOutput, sample as sample_rows
from engine.scheduler import layer_taps
from engine.scheduler.results import prompt_logprobs
from engine.scheduler.step import Step

if TYPE_CHECKING:
    from engine.scheduler.model_runner import ModelRunner
    from engine.scheduler.state import SchedulerState


def forward(runner: ModelRunner, step: Step) -> torch.Tensor:
    batch = step.forward_batch
    if hooks.has("engine_forward_before"):
        hooks.call("engine_forward_before", batch=batch, rids=step.rids)
    logits = runner.forward(batch)
    if batch.taps is not None:
        layer_taps.deliver(step)
    if hooks.has("engine_forward_after"):
        hooks.call("engine_forward_after", batch=batch, rids=step.rids, logits=logits)
    return logits


def sample(state: SchedulerState, step: Step, logits: torch.Tensor) -> SampleOutput | None:
    """Prompt logprobs from the extra rows of a prefill, then one token per ordinary row (None: no
    ordinary row samples), and the beam searches' selections (kept in the step). The logits hook sees
    every row once: the ordinary rows' processed logits, then the beam rows' processed log-probabilities."""
    rows = step.rows
    n, nb = len(rows), len(step.beam_starts) or len(step.beam_reqs)
    if step.prompt_logprobs:
        prompt_logprobs(state, step, logits[n + nb :])
    tap_failed = layer_taps.failed(step)  # a plugin tap raised on these requests' rows
    beam = beam_stage.prepare(state, step, logits[n : n + nb]) if nb else None
    if beam is not None and tap_failed:
        for r in beam.reqs:
            if r.rid in tap_failed:
                step.beam_failed.setdefault(id(r), tap_failed[r.rid])
    logits = logits[:n]
    hook = hooks.has("engine_process_logits")
    out = None
    if n:
        output_ids = [r.output_ids for r in rows.reqs] if rows.sampling.any_processor else []
        on_logits = None
        if hook:

            def on_logits(processed: torch.Tensor) -> None:
                if beam is None:
                    hooks.call(
                        "engine_process_logits",
                        logits=processed,
                        rids=rows.rids,
                        reqs=rows.reqs,
                        beams=[None] * n,
                    )
                    return
                both = torch.cat([processed, beam.scores])
                hooks.call(
                    "engine_process_logits",
                    logits=both,
                    rids=rows.rids + beam.rids,
                    reqs=rows.reqs + beam.reqs,
                    beams=[None] * n + beam.beams,
                )
                processed.copy_(both[:n])
                beam.scores = both[n:]

        grammar = (lambda lg: state.grammars.mask(lg, rows.matchers)) if rows.any_grammar else None  # noqa: E731
        out = sample_rows(
            logits,
            rows.sampling,
            rows.out_lens,
            rows.stop_table,
            output_ids,
            state.processors,
            on_logits,
            grammar,
        )
        if tap_failed:  # they end here, without a token
            for i, rid in enumerate(rows.rids):
                if rid in tap_failed:
                    out.failed.setdefault(i, tap_failed[rid])
        if hooks.has("engine_sample_after"):
            hooks.call(
                "engine_sample_after", rids=rows.rids, next_ids=out.next_ids, logprobs=out.logprobs
            )
    elif beam is not None and hook:
        hooks.call(
            "engine_process_logits",
            logits=beam.scores,
            rids=beam.rids,
            reqs=beam.reqs,
            beams=beam.beams,
        )
    if beam is not None:
        beam_stage.select(state, step, beam)
    return out

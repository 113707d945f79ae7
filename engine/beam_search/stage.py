"""Beam search in the scheduler's stages: what each stage does for beam rows, called from the stage's
own module (prefill admission, decode inputs, sample, process results, endings, memory pressure).

A beam search is admitted like any request, with K request slots and its whole KV need reserved up
front (prompt + K tokens per decode step). Its prompt's last logits give the first selection; then its
K beams decode as rows of the ordinary decode step. It emits nothing until it ends, and then only the
returned hypotheses (BeamSearchOut), which alone the detokenizer decodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine import hooks
from engine.beam_search.batch import BeamGroup, beam_step_hook, selection_failed, start_sampling
from engine.scheduler.batch import stop_table
from engine.scheduler.finish import abort_held, finished_hook
from engine.beam_search.params import beam_problem, check_beam
from engine.beam_search.hidden import beam_result
from engine.beam_search.selection import BeamSelection, Hypothesis
from engine.hooks import HookError
from engine.ipc.messages import (
    BatchTokenOut,
    BeamHypothesis,
    BeamSearchOut,
    FinishReason,
    NO_TOKEN,
    RequestMeta,
    TokenizedRequest,
)
from engine.sampling.sampler import process_logits

if TYPE_CHECKING:
    from engine.scheduler.request import Req
    from engine.scheduler.state import SchedulerState
    from engine.scheduler.step import Step


# ------------------------------------------------------------------ arrival and admission


def arrival_problem(state: SchedulerState, r: TokenizedRequest) -> str | None:
    """Why a beam search cannot be queued here (the user process checks the same)."""
    problem = check_beam(r.beam, r.sampling, state.req_to_token.size)
    if problem is None and r.return_logprob:
        problem = "return_logprob: a beam search returns cumulative logprobs, not per-token ones"
    return problem


def never_fits(state: SchedulerState, req: Req) -> str | None:
    return beam_problem(
        req.prompt_len, req.sampling, req.beam, state.req_to_token.size, state.max_total_tokens
    )


def admission_need(req: Req, take: int) -> int:
    """Pool tokens to admit it now: this step's prompt tokens plus every token its beams may take."""
    return take + req.beam.width * max(req.sampling.max_new_tokens - 1, 0)


def take_slots(state: SchedulerState, req: Req) -> None:
    """The K-1 extra request slots its beams will use (admission checked they are free)."""
    req.beam_slots = [state.req_to_token.alloc() for _ in range(req.beam.width - 1)]


# ------------------------------------------------------------------ sample


def process_starts(
    state: SchedulerState, reqs: list[Req], logits: torch.Tensor, failed: dict[int, str]
) -> torch.Tensor:
    """The prompts' last log-probabilities, processed (one row per starting search)."""
    st = start_sampling(reqs, 1, state.vocab_size, state.device)
    out_lens = torch.zeros(len(reqs), dtype=torch.int64, device=state.device)
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = [[] for _ in reqs]
    matchers = [r.matcher for r in reqs]
    grammar = (
        (lambda lg: state.grammars.mask(lg, matchers, failed))
        if any(m is not None for m in matchers)
        else None
    )  # noqa: E731
    return process_logits(
        logprobs,
        st,
        out_lens,
        stop_table(reqs, 1, state.device),
        ids,
        state.processors,
        failed,
        [0] * len(reqs),
        grammar,
    )


def select_starts(
    state: SchedulerState, reqs: list[Req], scores: torch.Tensor, failed: dict[int, str]
) -> list:
    """Each starting search's first selection; one that raises goes into `failed` and fails alone."""
    out = []
    for i, req in enumerate(reqs):
        b = req.beam
        try:
            selection = BeamSelection(
                b.width,
                req.sampling.max_new_tokens,
                req.stop_ids,
                b.length_penalty,
                b.early_stopping,
                state.device,
            )
            parents, tokens = selection.step(scores[i : i + 1])
        except Exception as exc:  # noqa: BLE001 - this search alone
            failed[id(req)] = selection_failed(exc)
            continue
        out.append((req, selection, parents, tokens))
    return out


@dataclass
class BeamScores:
    """The beam rows of a step after processing, as the logits hook sees them."""

    scores: torch.Tensor  # [rows, V] processed log-probabilities
    rids: list[str]
    reqs: list
    beams: list[int | None]  # each row's beam index


def prepare(state: SchedulerState, step: Step, logits: torch.Tensor) -> BeamScores:
    """Log-probabilities of the beam rows, processed (bias, penalties, min_new_tokens, custom
    processors); a custom processor's failure is kept in the step and fails its search only."""
    failed: dict[int, str] = {}
    if step.beam_starts:
        reqs = step.beam_starts
        scores = process_starts(state, reqs, logits, failed)
        beams: list[int | None] = [0] * len(reqs)
    else:
        reqs = state.beams.reqs
        scores = state.beams.process(logits, state.processors, failed, state.grammars)
        beams = list(state.beams.beam_index)
    step.beam_failed = {id(reqs[i]): m for i, m in failed.items()}
    return BeamScores(scores, [r.rid for r in reqs], list(reqs), beams)


def select(state: SchedulerState, step: Step, beam: BeamScores) -> None:
    """One selection per search (kept in the step for process results); a selection that raises fails
    its search alone, as a failing processor does."""
    if hooks.has("engine_process_logits"):
        matchers = (
            [r.matcher for r in step.beam_starts] if step.beam_starts else state.beams.matchers
        )
        if any(m is not None for m in matchers):
            refuse_stops(beam, matchers)
    if step.beam_starts:
        reqs = step.beam_starts
        ok = [i for i in range(len(reqs)) if id(reqs[i]) not in step.beam_failed]
        step.beam_out = select_starts(
            state, [reqs[i] for i in ok], beam.scores[ok], step.beam_failed
        )
    else:
        step.beam_out = state.beams.select(beam.scores, step.beam_failed)


def refuse_stops(beam: BeamScores, matchers: list) -> None:
    """A stop token a hook put back after the grammar's mask (engine_process_logits runs after it) to
    -inf where the row's grammar refuses it: a beam that takes a stop token ends as a hypothesis in the
    selection itself, before any matcher sees the token (other refused tokens drop out there:
    batch.advance_matchers). Only with the hook: otherwise the mask has already done it."""
    for row, m in enumerate(matchers):
        if m is None or m.is_terminated():
            continue
        stops = torch.tensor(beam.reqs[row].stop_ids, dtype=torch.int64, device=beam.scores.device)
        for stop in stops[
            ~torch.isneginf(beam.scores[row, stops])
        ].tolist():  # those the hook left open
            if not m.fork().accept_token(stop):
                beam.scores[row, stop] = float("-inf")


# ------------------------------------------------------------------ process results


def process_results(state: SchedulerState, step: Step) -> None:
    if step.beam_starts:
        _start(state, step)
    elif step.beam_out is not None:
        _advance(state, step)


def _start(state: SchedulerState, step: Step) -> None:
    for r in step.beam_starts:
        if id(r) in step.beam_failed:
            abort_held(state, [r], [r.kv_len], step.beam_failed[id(r)], keep_kv=False)
    now = time.time_ns()
    for req, selection, parents, tokens in step.beam_out:
        # shared by every beam, and by later requests with the same prompt
        state.kv.cache_prompt(req)
        req.first_token_ns = now
        group = state.beams.start(req, selection, tokens)
        state.counters["generated_tokens"] += group.width
        if group.failed is not None:
            abort(state, [group], group.failed)
        elif _hook(state, group, parents, tokens) and selection.done:
            finish(state, [group])


def _advance(state: SchedulerState, step: Step) -> None:
    beams = state.beams
    failed = [g for g in beams.groups if id(g.req) in step.beam_failed]
    choices = step.beam_out
    if failed:
        keep = [i for i, g in enumerate(beams.groups) if id(g.req) not in step.beam_failed]
        for g in failed:
            abort(state, [g], step.beam_failed[id(g.req)], keep_kv=False)
        choices = [choices[i] for i in keep]
    beams.advance(choices)
    state.counters["generated_tokens"] += beams.num_rows
    done = []
    for g, (parents, tokens) in zip(list(beams.groups), choices):
        if g.failed is not None:
            abort(state, [g], g.failed)
        elif _hook(state, g, parents, tokens) and g.selection.done:
            done.append(g)
    if done:
        finish(state, done)


def _hook(state: SchedulerState, g: BeamGroup, parents: torch.Tensor, tokens: torch.Tensor) -> bool:
    """engine_beam_step; a failing plugin fails this search only. Returns whether it still runs."""
    if not hooks.has("engine_beam_step"):
        return True
    try:
        beam_step_hook(g, parents, tokens)
    except HookError as exc:
        abort(state, [g], str(exc))
        return False
    return True


# ------------------------------------------------------------------ endings


def _free(state: SchedulerState, g: BeamGroup, keep_kv: bool = True) -> None:
    """Every generated token back to the pool; the prompt to the cache (unlocked), the slots freed."""
    state.kv.pool.free(state.beams.release_tokens(g))
    state.kv.free_request(g.req, g.req.prompt_len, keep=keep_kv)


def _meta(
    g: BeamGroup, completion_tokens: int, hyps: list[Hypothesis] | None = None
) -> RequestMeta:
    """Its counters, and its hidden states when it asked for them (engine/taps): the prompt's, and
    each returned hypothesis's own generated rows (those of `hyps`)."""
    taps = g.req.taps
    hidden = None
    if g.hidden is not None:
        hyps = hyps or []
        hidden = beam_result(taps, g.hidden.generated(hyps), hyps)
    elif taps is not None and taps.hidden is not None:
        hidden = taps.result(0)
    return RequestMeta(g.req.prompt_len, completion_tokens, g.req.cached_tokens, hidden)


def finish(state: SchedulerState, groups: list[BeamGroup]) -> None:
    """Searches that ended: their R best hypotheses to the detokenizer, their memory freed."""
    for g in groups:
        req, sel = g.req, g.selection
        hyps = []
        found = sel.results(req.beam.num_return)
        for h in found:
            reason = (
                FinishReason("stop", matched=h.output_ids[-1])
                if h.stopped
                else FinishReason("length", length=len(h.output_ids))
            )
            hyps.append(BeamHypothesis(h.output_ids, h.logprob, h.score, reason))
        req.finished = hyps[0].finish if hyps else FinishReason("length", length=0)
        req.beam_steps = sel.steps
        _free(state, g)
        state.beams.remove([g])
        p = req.sampling
        out = BeamSearchOut(
            req.rid,
            hyps,
            _meta(g, sum(len(h.output_ids) for h in hyps), found),
            g.width,
            sel.steps,
            p.skip_special_tokens,
            p.spaces_between_special_tokens,
            req.trace_context,
        )
        state.outbox.send(out)
        state.counters["finished_requests"] += 1
        finished_hook(req)


def abort(
    state: SchedulerState, groups: list[BeamGroup], message: str, keep_kv: bool = True
) -> None:
    """Searches that fail or are aborted: all their beams freed, reported finished with reason abort."""
    for g in groups:
        reason = g.req.finished = FinishReason("abort", message=message)
        g.req.beam_steps = g.selection.steps
        _free(state, g, keep_kv)
        state.beams.remove([g])
        out = BatchTokenOut([g.req.rid], [NO_TOKEN], [reason], [_meta(g, 0)])
        state.outbox.send(out)
        state.counters["aborted_requests"] += 1
        finished_hook(g.req)


def retract_last(state: SchedulerState) -> Req:
    """Memory pressure: the most recent search starts over later (its prompt stays cached; beam search
    is deterministic, so the result is the same)."""
    g = state.beams.groups[-1]
    _free(state, g)
    state.beams.remove([g])
    req = g.req
    req.fill_ids = req.input_ids
    return req

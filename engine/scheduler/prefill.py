"""Building a prefill (EXTEND) step: admit waiting requests into memory and slots, then lay out their
prompts after their cached prefixes, up to a token budget (the last one possibly cut into a chunk).

Memory is admitted optimistically: the prompt plus an estimate of the new tokens (the estimate shrinks
while all goes well, and grows after a retraction).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine import hooks
from engine.beam_search import stage as beam_stage
from engine.grammar.stage import constraint_of
from engine.hooks import HookError
from engine.sampling.batch_params import SamplingTensors
from engine.scheduler.batch import RunningBatch, sampling_tensors
from engine.scheduler.endings import abort_reqs, abort_rids, finish_unstarted
from engine.scheduler.policy import LPM_MAX_QUEUE
from engine.scheduler.request import Req
from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState

# a request's remaining max_new_tokens counts at most this much in the estimate
CLIP_NEW_TOKENS = 4096


def plan_prefill(state: SchedulerState) -> list[tuple[Req, int, int]]:
    """Pick (request, tokens already in the pool, tokens to compute now) for a prefill step.

    The budget is chunked_prefill_size tokens (max_prefill_tokens with chunking off, when an
    over-budget prompt still runs whole, alone). Memory: what the step takes plus an estimate of
    every admitted request's new tokens must fit in free plus evictable pool tokens.
    """
    chunk = state.config.chunked_prefill_size
    budget = chunk if chunk > 0 else state.config.max_prefill_tokens
    kv = state.kv
    reserved = int(state.plan.new_token_ratio * state.running.remaining_new_tokens(CLIP_NEW_TOKENS))
    reserved += state.beams.remaining_tokens()  # beam searches keep their whole reservation
    entries: list[tuple[Req, int, int]] = []
    req = in_progress = state.plan.chunked  # its prompt is not cached until its last chunk is done
    if req is not None:
        take = min(len(req.fill_ids) - req.kv_len, budget)
        # leave the running rows their next token
        if take > kv.headroom - len(state.running) - state.beams.num_rows:
            return []  # decode steps will finish requests and free memory
        entries.append((req, req.kv_len, take))
        state.plan.admitted(req)
        budget -= take
        # a search's beams too
        reserved += beam_stage.admission_need(req, take) if req.beam is not None else take
        if req.kv_len + take < len(req.fill_ids):
            return entries
        state.plan.chunked = None
    if not state.waiting or budget <= 0 or not admissible(state, reserved, entries):
        return entries
    taken: list[Req] = []
    free_slots = state.req_to_token.available
    ordered = state.waiting.ordered(state.config.schedule_policy, kv.cache, in_progress, free_slots)
    if hooks.has("engine_schedule"):
        shown = list(ordered)
        try:
            hooks.call("engine_schedule", waiting=ordered, running=len(state.running))
            ids = [id(r) for r in ordered]
            if len(set(ids)) != len(ids) or not set(ids) <= {id(r) for r in shown}:
                raise HookError(
                    ", ".join(hooks.implementers("engine_schedule")),
                    "engine_schedule",
                    ValueError("may only reorder or remove the waiting requests"),
                )
        except HookError as exc:  # it touched every waiting request it was shown
            abort_rids(state, dict.fromkeys(r.rid for r in shown), str(exc))
            return entries
    for req in ordered:
        if budget <= 0 or not state.req_to_token.available:
            break
        if req.beam is not None and state.req_to_token.available < req.beam.width:
            break  # a slot per beam
        if req.grammar is not None and req.matcher is None:
            if not req.grammar.done():
                continue  # its grammar is compiling: the requests behind it go on
            limit = state.grammars.problem(req.grammar, constraint_of(req.sampling)[0])
            if limit is not None:
                taken.append(req)
                finish_unstarted(state, req, limit)
                continue
        limit = never_fits(state, req)
        if limit is not None:
            taken.append(req)
            finish_unstarted(state, req, limit)
            continue
        prefix = kv.lend_prefix(req)  # locked first: a prefix in use is no longer evictable
        ext = len(req.fill_ids) - prefix
        take = min(ext, budget) if chunk > 0 else ext
        if chunk <= 0 and entries and take > budget:
            kv.unlend(req)
            break
        need = need_of(state, req, take)
        alone = not entries and not len(state.running) and not state.beams
        # reserved whole: beams are never retracted part-way for lack of KV
        if req.beam is not None:
            need = beam_stage.admission_need(req, take)
            alone = alone and need <= kv.headroom
        if need > kv.headroom - reserved and not (alone and take <= kv.headroom):
            kv.unlend(req)
            break
        kv.assign_slot(req)
        state.plan.admitted(req)  # it holds a slot and a prefix lock now
        if req.beam is not None:
            beam_stage.take_slots(state, req)
        if req.grammar is not None and req.matcher is None:
            try:
                req.matcher = state.grammars.matcher(req.grammar)
            except Exception as exc:  # noqa: BLE001 - this request fails alone, before any work
                kv.free_request(req, req.kv_len)
                taken.append(req)
                finish_unstarted(
                    state,
                    req,
                    f"{constraint_of(req.sampling)[0]}: the grammar matcher could not be "
                    f"made: {type(exc).__name__}: {exc}",
                )
                continue
        first = req.admissions == 0
        if first:
            req.admitted_ns = time.time_ns()
            req.cached_tokens = min(prefix, req.prompt_len)
        req.admissions += 1
        if hooks.has("engine_request_admitted"):
            try:
                hooks.call("engine_request_admitted", req=req, cached_tokens=prefix)
            except HookError as exc:  # this request fails alone, before any work
                kv.free_request(req, req.kv_len)
                taken.append(req)
                finish_unstarted(state, req, str(exc))
                continue
        if first:  # counted once admitted: a prompt the hook refused was never taken in
            state.counters["prompt_tokens"] += req.prompt_len
            state.counters["prompt_cache_hit_tokens"] += req.cached_tokens
        state.counters["cache_hit_tokens"] += prefix
        entries.append((req, prefix, take))
        taken.append(req)
        budget -= take
        reserved += need
        if take < ext:
            state.plan.chunked = req
            break
    state.waiting.remove(taken)
    return entries


def admissible(state: SchedulerState, reserved: int, entries: list) -> bool:
    """Whether a waiting request could be admitted at all: a request slot is free, and the pool has room
    beyond what the running requests reserve for the least any waiting request needs (a request alone
    may use it all). Else the queue is not ordered (a prefix match, slices and a tree insert per waiting
    request) for nothing."""
    if not state.req_to_token.available:
        return False
    if not entries and not len(state.running) and not state.beams:
        return True
    room = state.kv.headroom - reserved
    # a long queue is not ordered anyway: no need to look
    if room < 1 or len(state.waiting) > LPM_MAX_QUEUE:
        return room >= 1
    # past any request's least need: no loop
    if room >= 1 + int(state.plan.new_token_ratio * CLIP_NEW_TOKENS):
        return True
    return room >= min(least_need(state, r) for r in state.waiting)


def need_of(state: SchedulerState, req: Req, take: int) -> int:
    """Pool tokens admitting a request asks for: the `take` tokens computed now and an estimate of its
    new tokens (a beam search asks for its whole reservation instead: beam_stage.admission_need)."""
    remaining = req.sampling.max_new_tokens - len(req.output_ids)
    return take + int(state.plan.new_token_ratio * min(remaining, CLIP_NEW_TOKENS))


def least_need(state: SchedulerState, req: Req) -> int:
    """The least pool room admission can ask of a request: one token to compute (all the rest could be
    cached) and its estimated new tokens. A beam search's whole reservation is not bounded here: 1."""
    return 1 if req.beam is not None else need_of(state, req, 1)


def build_sampling(
    state: SchedulerState, entries: list[tuple[Req, int, int]]
) -> tuple[list, SamplingTensors]:
    """The sampling tensors of the requests whose prompt this step completes, built before anything is
    allocated. If building them raises, each is built alone and only those that fail are aborted (they
    hold a slot and a prefix, nothing more yet), not every request admitted with them."""
    vocab, dev = state.vocab_size, state.device
    completing = [
        r for r, prefix, take in entries if r.beam is None and prefix + take == len(r.fill_ids)
    ]
    try:
        return entries, sampling_tensors(completing, vocab, dev)
    except Exception:  # noqa: BLE001 - found below, request by request
        pass
    failed: dict[int, str] = {}
    for req in completing:
        try:
            sampling_tensors([req], vocab, dev)
        except Exception as exc:  # noqa: BLE001 - this request alone
            failed[id(req)] = f"sampling: {type(exc).__name__}: {exc}"
    for req in completing:
        if id(req) in failed:
            abort_reqs(state, [req], [req.kv_len], failed[id(req)])
    entries = [e for e in entries if id(e[0]) not in failed]
    completing = [r for r in completing if id(r) not in failed]
    return entries, sampling_tensors(completing, vocab, dev)


def never_fits(state: SchedulerState, req: Req) -> str | None:
    """Why a request can never run here (the user process refuses these up front; this is the guard)."""
    n = req.prompt_len
    if n >= state.context_len:
        return f"the prompt has {n} tokens but context_length is {state.context_len}"
    if req.beam is not None:
        return beam_stage.never_fits(state, req)
    most = n + req.sampling.max_new_tokens - 1
    if most > state.max_total_tokens:
        return (
            f"the prompt ({n} tokens) plus max_new_tokens needs up to {most} KV tokens but the pool holds "
            f"max_total_tokens={state.max_total_tokens}"
        )
    return None


def prefill_step(state: SchedulerState, entries: list[tuple[Req, int, int]]) -> Step | None:
    """The EXTEND step for the planned entries (None if none is left: each failed building its sampling)."""
    entries, sampling = build_sampling(state, entries)
    if not entries:
        return None
    dev = state.device
    takes = [take for _, _, take in entries]
    total = sum(takes)
    loc = state.kv.alloc(total)
    takes_t = torch.tensor(takes, dtype=torch.int64, device=dev)
    prefix_t = torch.tensor([p for _, p, _ in entries], dtype=torch.int64, device=dev)
    ends = torch.cumsum(takes_t, 0)
    positions = torch.arange(total, device=dev) + torch.repeat_interleave(
        prefix_t - (ends - takes_t), takes_t
    )
    slots = torch.tensor([r.slot for r, _, _ in entries], dtype=torch.int64, device=dev)
    state.req_to_token.table[torch.repeat_interleave(slots, takes_t), positions] = loc
    input_ids: list[int] = []
    completing, logits_rows = [], []
    # beam searches: their prompt's last row, after the ordinary rows
    beam_starts, beam_rows = (
        [],
        [],
    )
    extra_rows: list[
        int
    ] = []  # prompt logprobs: hidden rows of positions logprob_from .. prompt_len - 2
    prompt_logprobs: list[tuple[Req, int, int, int]] = []
    start = 0
    for i, (req, prefix, take) in enumerate(entries):
        input_ids += req.fill_ids[prefix : prefix + take]
        req.kv_len = prefix + take
        if req.kv_len == len(req.fill_ids):
            (beam_starts if req.beam is not None else completing).append(req)
            (beam_rows if req.beam is not None else logits_rows).append(start + take - 1)
        if req.logprob_from is not None and not req.header_sent:
            lo, hi = max(prefix, req.logprob_from), min(prefix + take, req.prompt_len - 1)
            if hi > lo:
                prompt_logprobs.append((req, len(extra_rows), hi - lo, lo))
                extra_rows.extend(range(start + lo - prefix, start + hi - prefix))
        start += take
    state.counters["prefill_steps"] += 1
    state.counters["prefill_tokens"] += total
    if len(completing) + len(beam_starts) < len(entries):
        state.counters["chunked_prefill_steps"] += 1
    seq_lens = prefix_t + takes_t
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
        positions=positions,
        out_cache_loc=loc,
        req_slots=slots,
        seq_lens=seq_lens,
        max_seq_len=int(seq_lens.max()),
        logits_indices=torch.tensor(
            logits_rows + beam_rows + extra_rows, dtype=torch.int64, device=dev
        ),
        extend_lens=takes,
        prefix_lens=[p for _, p, _ in entries],
    )
    rows = RunningBatch(completing, state.vocab_size, dev, sampling)
    return Step(
        batch, rows, [req for req, _, _ in entries], prompt_logprobs, beam_starts=beam_starts
    )

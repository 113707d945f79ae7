"""The process-results stage: append each row's token, finish rows that are done, emit one message per step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.beam_search import stage as beam_stage
from engine.ipc.messages import (
    BatchTokenOut,
    FinishReason,
    NO_TOKEN,
    RequestHeader,
    TokenLogprob,
    TopLogprobs,
)
from engine.sampling.sampler import SampleOutput
from engine.scheduler.batch import RunningBatch
from engine.scheduler.finish import finished_hook, request_meta
from engine.scheduler.request import Req
from engine.scheduler.step import Step
from engine.model.forward_batch import ForwardMode

if TYPE_CHECKING:
    from engine.scheduler.state import SchedulerState


def process_results(state: SchedulerState, step: Step, sampled: SampleOutput | None) -> None:
    """Append each row's token, finish rows that hit a stop token or their length, emit one message.
    After a prefill, requests that go on decoding put their prompt in the prefix cache."""
    if step.beam_out is not None:
        beam_stage.process_results(state, step)
    rows = step.rows
    if sampled is None:
        return
    next_ids = sampled.next_ids
    rows.last_ids = next_ids
    rows.out_lens = rows.out_lens + 1
    hit_stop = rows.stop_table.hits(next_ids)
    done = hit_stop | (rows.out_lens >= rows.max_new)
    ids = next_ids.tolist()
    rids = rows.rids
    reqs = rows.reqs
    if rows.any_grammar:  # each constrained row's matcher takes its token (a refusal fails the row)
        for i, problem in state.grammars.accept(rows.matchers, ids).items():
            sampled.failed.setdefault(i, problem)
    # a custom processor or a grammar failed on these rows: they end here, without a token
    if sampled.failed:
        for i in sampled.failed:
            ids[i] = NO_TOKEN
        done[list(sampled.failed)] = True
    for req, token in zip(reqs, ids):
        if token != NO_TOKEN:
            req.output_ids.append(token)
    finished: list = [None] * len(ids)
    meta: list = [None] * len(ids)
    headers = first_headers(state, reqs) if step.mode is ForwardMode.EXTEND else []
    logprobs = output_logprobs(rows, sampled) if sampled.logprobs is not None else []
    state.counters["generated_tokens"] += len(ids) - len(sampled.failed)
    # freeing a finished request failed: raised once the step's answer is sent
    error: Exception | None = None
    if bool(done.any()):
        done_list = done.tolist()
        stop_list = hit_stop.tolist()
        kv_lens = rows.kv_lens.tolist()
        for i, is_done in enumerate(done_list):
            if not is_done:
                continue
            req = reqs[i]
            n_out = len(req.output_ids)
            if i in sampled.failed:
                reason = FinishReason("abort", message=sampled.failed[i])
                state.counters["aborted_requests"] += 1
            else:
                reason = (
                    FinishReason("stop", matched=ids[i])
                    if stop_list[i]
                    else FinishReason("length", length=n_out)
                )
                state.counters["finished_requests"] += 1
            finished[i] = req.finished = reason
            meta[i] = request_meta(req)
            try:
                state.kv.free_request(req, kv_lens[i], keep=i not in sampled.failed)
            except Exception as exc:  # noqa: BLE001 - marked finished, so the failure handler skips it: answer it first
                error = error or exc
            finished_hook(req)
        rows.filter(~done, [not d for d in done_list])
    out = BatchTokenOut(rids, ids, finished, meta, headers, logprobs)
    state.outbox.send(out)
    # the step fails as it would have (its other requests end), none unanswered
    if error is not None:
        raise error
    if step.mode is ForwardMode.EXTEND and len(rows):
        for req in rows.reqs:
            state.kv.cache_prompt(req)
        state.running.merge(rows)


def first_headers(state: SchedulerState, reqs: list[Req]) -> list:
    """A RequestHeader for each request whose first output this is (prefill steps only)."""
    headers: list = []
    now = time.time_ns()
    for req in reqs:
        if req.header_sent:
            headers.append(None)
            continue
        req.header_sent = True
        req.first_token_ns = now
        p = req.sampling
        headers.append(
            RequestHeader(
                req.prompt_len,
                req.cached_tokens,
                p.stop,
                p.min_new_tokens,
                p.skip_special_tokens,
                p.spaces_between_special_tokens,
                req.input_logprobs,
                req.input_top,
                req.trace_context,
                req.seq,
                req.taps is not None and req.taps.hidden is not None,
            )
        )
    return headers if any(h is not None for h in headers) else []


def output_logprobs(rows: RunningBatch, sampled: SampleOutput) -> list:
    want = rows.sampling.want_logprob.tolist()
    if not any(want):
        return []
    lps = sampled.logprobs.tolist()
    top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
    top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    out: list = []
    for i, req in enumerate(rows.reqs):
        if not want[i]:
            out.append(None)
            continue
        k = req.top_logprobs_num
        top = TopLogprobs(top_ids[i][:k], top_lps[i][:k]) if k and top_ids is not None else None
        out.append(TokenLogprob(lps[i], top))
    return out


def prompt_logprobs(state: SchedulerState, step: Step, logits: torch.Tensor) -> None:
    """Each prompt token's logprob given the tokens before it, from the prefill's extra rows."""
    logprobs = torch.log_softmax(logits, dim=-1)
    for req, first, count, pos in step.prompt_logprobs:
        targets = torch.tensor(
            req.input_ids[pos + 1 : pos + 1 + count], dtype=torch.int64, device=logits.device
        )
        block = logprobs[first : first + count]
        req.input_logprobs += block.gather(1, targets[:, None]).squeeze(1).tolist()
        k = req.top_logprobs_num
        if k:
            values, indices = block.topk(k, dim=-1)
            req.input_top += [TopLogprobs(i, v) for i, v in zip(indices.tolist(), values.tolist())]

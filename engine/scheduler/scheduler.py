"""The scheduler: one loop of stages, each a method later hooks and spans attach to.

    recv_requests -> schedule -> forward -> sample -> process_results

A step is either a prefill (EXTEND: new requests' prompts after their cached prefix, up to a token
budget, the last one possibly cut into a chunk) or a decode (every running request, one token).
Prefill goes first, except that while a prompt is being prefilled chunk by chunk, decode steps
alternate with its chunks so running requests keep producing tokens.

Memory is admitted optimistically (prompt plus an estimate of the new tokens, the estimate shrinking
while all goes well). When a decode step finds the pool short, the radix cache gives up unlocked
entries first; then the most recently admitted requests are retracted to the waiting queue, their
K/V kept in the cache where it survives, and resume later from there.
"""

from __future__ import annotations

import collections
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from engine import hooks
from engine.config import EngineConfig
from engine.hooks import HookError
from engine.hooks.types import StepRecord
from engine.ipc.channels import pull_socket, push_socket
from engine.ipc.messages import (
    AbortRequest,
    BatchTokenOut,
    Codec,
    FinishReason,
    FlushCache,
    GenerateBatch,
    NO_TOKEN,
    STOP_STRING_MATCHED,
    RequestHeader,
    RequestMeta,
    Stats,
    StatsRequest,
    ToDetokenizer,
    ToScheduler,
    TokenLogprob,
    TopLogprobs,
)
from engine.memory import ReqToTokenPool, TokenKVPool
from engine.memory.manager import KVManager
from engine.model.config import load_hf_config
from engine.model.loader import load_model
from engine.sampling.processors import ProcessorSet
from engine.sampling.sampler import SampleOutput, sample
from engine.scheduler.admission import check_request, clip_to_context
from engine.scheduler.batch import RunningBatch
from engine.scheduler.device import pool_size, resolve_device, resolve_dtype
from engine.scheduler.policy import order_waiting
from engine.scheduler.request import Req
from kernels.attention import ForwardBatch, ForwardMode, create_backend

CLIP_NEW_TOKENS = 4096  # a request's remaining max_new_tokens counts at most this much in the estimate
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per decode step
RETRACT_HEADROOM_STEPS = 4  # after a retraction, room for this many decode steps of what remains


@dataclass
class Step:
    """One scheduled step: the forward inputs plus the rows (with their sampling tensors) it serves."""

    forward_batch: ForwardBatch
    rows: RunningBatch  # DECODE: the running batch itself; EXTEND: requests whose prefill completes
    extend_reqs: list[Req] = field(default_factory=list)  # EXTEND: every request in the step, chunks too
    # EXTEND: prompt logprob rows after the next-token rows: (request, first extra row, rows, first position)
    prompt_logprobs: list[tuple[Req, int, int, int]] = field(default_factory=list)

    @property
    def mode(self) -> ForwardMode:
        return self.forward_batch.mode

    @property
    def rids(self) -> list[str]:
        """Every request in the step (for EXTEND, chunks that produce no token yet included)."""
        return [r.rid for r in self.extend_reqs] if self.extend_reqs else self.rows.rids


class Scheduler:
    def __init__(self, config: EngineConfig, model_dir: str, endpoints: dict, progress=None) -> None:
        torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        hf_config = load_hf_config(model_dir)
        max_pos = hf_config.max_position_embeddings
        self.context_len = min(config.context_length or max_pos, max_pos)
        self.model, self.model_config = load_model(
            model_dir, hf_config, self.dtype, self.device, self.context_len, progress
        )
        mc = self.model_config
        bytes_per_token = TokenKVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        cap = config.max_running_requests * self.context_len
        self.max_total_tokens = pool_size(config.max_total_tokens, config.mem_fraction, bytes_per_token, self.device, cap)
        self.req_to_token = ReqToTokenPool(config.max_running_requests, self.context_len, self.device)
        self.kv_pool = TokenKVPool(self.max_total_tokens, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        self.kv = KVManager(self.kv_pool, self.req_to_token, config.enable_prefix_cache, self.device)
        self.backend = create_backend(
            config.attention_backend,
            self.device,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            scale=mc.head_dim**-0.5,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token.table,
        )
        self.zmq_ctx = zmq.Context(1)
        self.recv_sock = pull_socket(self.zmq_ctx, endpoints["scheduler"])
        self.send_sock = push_socket(self.zmq_ctx, endpoints["detokenizer"])
        self.recv_codec = Codec(ToScheduler)
        self.send_codec = Codec(ToDetokenizer)
        self.waiting: list[Req] = []
        self.running = RunningBatch.empty(mc.vocab_size, self.device)
        self.chunked_req: Req | None = None  # a prompt part-way through a chunked prefill
        self._planned: list[Req] = []  # requests the schedule now running has admitted (to fail if it raises)
        self._phase = ForwardMode.EXTEND  # which half of schedule() is running
        self.last_mode: ForwardMode | None = None
        self.new_token_ratio = config.init_new_token_ratio
        self.processors = ProcessorSet()
        self.counters = collections.Counter()
        self.busy_seconds: collections.Counter = collections.Counter()  # wall time per stage, since start
        self.info = {
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_total_tokens": self.max_total_tokens,
            "max_running_requests": config.max_running_requests,
            "context_length": self.context_len,
            "vocab_size": mc.vocab_size,
            "architecture": mc.architecture,
            "eos_token_ids": list(mc.eos_token_ids),
            "kv_bytes_per_token": bytes_per_token,
        }

    # ------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        while True:
            try:
                ran = self.run_once()
            except Exception:  # noqa: BLE001 - the last guard: report, keep serving the other requests
                traceback.print_exc()
                ran = False
                time.sleep(0.01)
            if not ran and self.waiting:
                time.sleep(0.001)  # requests wait but none could start (a plugin holds them back): no hot spin

    @torch.inference_mode()
    def run_once(self, block: bool = True) -> bool:
        """One turn of the loop: receive (blocking only if idle and `block`), then at most one step.
        Returns whether a step ran.

        A step that raises fails only the requests in it (finish reason "abort" with the error);
        the engine keeps serving the rest. Everything runs in inference mode: the batch's tensors
        are created and updated in place from one step to the next.
        """
        clock = time.perf_counter
        busy = self.busy_seconds
        idle = not (self.waiting or len(self.running) or self.chunked_req)
        self.recv_requests(block=block and idle)
        t0 = clock()
        try:
            step = self.schedule()
        except Exception as exc:  # noqa: BLE001 - fail what the schedule touched, never the process
            self._schedule_failed(f"{type(exc).__name__}: {exc}")
            return True
        if step is None:
            return False
        t1 = clock()
        t2 = t3 = None
        reqs = step.extend_reqs or step.rows.reqs  # kept: finishing requests leave step.rows
        try:
            logits = self.forward(step)
            t2 = clock()
            sampled = self.sample(step, logits)
            t3 = clock()
            self.process_results(step, sampled)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            message = f"{type(exc).__name__}: {exc}"
            self._abort_step(step, message)
            if hooks.has("engine_step_end"):
                self._step_end_hook(step, reqs, (t0, t1, t2, t3, clock()), message)
            return True
        t4 = clock()
        busy["schedule"] += t1 - t0
        busy[f"forward_{step.mode.value}"] += t2 - t1
        busy["sample"] += t3 - t2
        busy["process_results"] += t4 - t3
        if hooks.has("engine_step_end"):
            self._step_end_hook(step, reqs, (t0, t1, t2, t3, t4), None)
        return True

    @staticmethod
    def _step_end_hook(step: Step, reqs: list[Req], times: tuple, error: str | None) -> None:
        """engine_step_end with wall-clock times: the loop's perf_counter marks, anchored once."""
        wall, perf = time.time_ns(), time.perf_counter()
        t0, t1, t2, t3, t4 = (None if t is None else wall - int((perf - t) * 1e9) for t in times)
        mode = "prefill" if step.mode is ForwardMode.EXTEND else "decode"
        record = StepRecord(mode, reqs, int(step.forward_batch.input_ids.numel()), t0, t1, t2, t3, t4, error)
        try:
            hooks.call("engine_step_end", step=record)
        except HookError as exc:  # the step is over: report, nothing to fail
            print(f"engine::scheduler: {exc}", file=sys.stderr)

    def close(self) -> None:
        """Close the sockets (the process exits without this; in-process users such as tests need it)."""
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
        self.zmq_ctx.term()

    # ------------------------------------------------------------------ stages

    def recv_requests(self, block: bool) -> None:
        """Drain the request socket; when nothing runs, block on it (no spinning on an idle machine).
        A message that cannot be handled is reported and dropped: it never stops the loop."""
        if block:
            self.recv_sock.poll(timeout=None)
        while True:
            try:
                data = self.recv_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self.recv_codec.decode(data)
            except msgspec.DecodeError as exc:  # not ours: drop it rather than die
                print(f"engine::scheduler: dropped a malformed message ({exc})", file=sys.stderr)
                continue
            try:
                self._handle(message)
            except Exception as exc:  # noqa: BLE001 - one message must not take the process down
                print(f"engine::scheduler: dropped a {type(message).__name__} message that failed "
                      f"({type(exc).__name__}: {exc})", file=sys.stderr)  # fmt: skip

    def _handle(self, message) -> None:
        if isinstance(message, GenerateBatch):
            self._admit_arrivals(message.reqs)
        elif isinstance(message, AbortRequest):
            self._abort_rids(_abort_targets(message), message.message)
        elif isinstance(message, StatsRequest):
            self.send_sock.send(self.send_codec.encode(self.stats(message.req_id)))
        elif isinstance(message, FlushCache):
            flushed = self.kv.cache.flush()
            self.send_sock.send(self.send_codec.encode(self.stats(message.req_id, flushed)))

    def _admit_arrivals(self, arrivals: list) -> None:
        """Queue each request that passes the arrival checks; answer the others with an abort naming the
        field at fault (each fails alone)."""
        eos = self.model_config.eos_token_ids
        now = time.time_ns()
        vocab = self.model_config.vocab_size
        live = self._live_rids()
        for r in arrivals:
            problem = check_request(r, vocab, self.context_len)
            if problem is not None:
                self._refuse(r, problem)
                continue
            if r.rid in live:  # reused: the user process only reuses a rid whose request it saw finish,
                # here by a stop string whose abort is still on its way from the detokenizer
                self._abort_rids({r.rid: {live[r.rid]}}, SUPERSEDED)
            r = clip_to_context(r, self.context_len)  # the user process does this too; be safe
            self.waiting.append(Req(
                r.rid, r.input_ids, r.sampling, eos, r.return_logprob, r.top_logprobs_num, r.logprob_start_len,
                r.trace_context, r.submitted_ns or now, now, r.seq,
            ))  # fmt: skip
            live[r.rid] = r.seq

    def _live_rids(self) -> dict[str, int]:
        """rid -> seq of every request the scheduler holds."""
        live = {r.rid: r.seq for r in self.waiting}
        live.update((r.rid, r.seq) for r in self.running.reqs)
        if self.chunked_req is not None:
            live[self.chunked_req.rid] = self.chunked_req.seq
        return live

    def _refuse(self, r, problem: str) -> None:
        """Answer a request that failed the arrival checks: finished, reason abort, nothing queued."""
        reason = FinishReason("abort", message=f"invalid request: {problem}")
        out = BatchTokenOut([r.rid], [NO_TOKEN], [reason], [RequestMeta(len(r.input_ids), 0, 0)])
        self.send_sock.send(self.send_codec.encode(out))
        self.counters["aborted_requests"] += 1

    def schedule(self) -> Step | None:
        """A prefill step if anything can be admitted, else a decode step of the running batch. While a
        chunked prefill is in progress, decode steps alternate with its chunks."""
        self._planned = []
        self._phase = ForwardMode.EXTEND
        running = len(self.running) > 0
        interleave = self.chunked_req is not None and running and self.last_mode is ForwardMode.EXTEND
        if not interleave:
            entries = self._plan_prefill()
            if entries:
                self.last_mode = ForwardMode.EXTEND
                return self._prefill_step(entries)
        self._phase = ForwardMode.DECODE
        if len(self.running) and self._make_room_for_decode():
            self.last_mode = ForwardMode.DECODE
            return self._decode_step()
        self.last_mode = None
        return None

    def forward(self, step: Step) -> torch.Tensor:
        batch = step.forward_batch
        if hooks.has("engine_forward_before"):
            hooks.call("engine_forward_before", batch=batch, rids=step.rids)
        logits = self.model(batch, self.backend)
        if hooks.has("engine_forward_after"):
            hooks.call("engine_forward_after", batch=batch, rids=step.rids, logits=logits)
        return logits

    def sample(self, step: Step, logits: torch.Tensor) -> SampleOutput | None:
        """Prompt logprobs from the extra rows of a prefill, then one token per row (None: a step of
        prompt chunks only, nothing to sample yet)."""
        rows = step.rows
        if step.prompt_logprobs:
            self._prompt_logprobs(step, logits[len(rows) :])
            logits = logits[: len(rows)]
        if not len(rows):
            return None
        output_ids = [r.output_ids for r in rows.reqs] if rows.sampling.any_processor else []
        on_logits = None
        if hooks.has("engine_process_logits"):
            def on_logits(processed: torch.Tensor) -> None:
                hooks.call("engine_process_logits", logits=processed, rids=rows.rids, reqs=rows.reqs)
        out = sample(logits, rows.sampling, rows.out_lens, rows.stop_table, output_ids, self.processors, on_logits)
        if hooks.has("engine_sample_after"):
            hooks.call("engine_sample_after", rids=rows.rids, next_ids=out.next_ids, logprobs=out.logprobs)
        return out

    def process_results(self, step: Step, sampled: SampleOutput | None) -> None:
        """Append each row's token, finish rows that hit a stop token or their length, emit one message.
        After a prefill, requests that go on decoding put their prompt in the prefix cache."""
        rows = step.rows
        if sampled is None:
            return
        next_ids = sampled.next_ids
        rows.last_ids = next_ids
        rows.out_lens = rows.out_lens + 1
        hit_stop = (next_ids[:, None] == rows.stop_table).any(dim=1)
        done = hit_stop | (rows.out_lens >= rows.max_new)
        ids = next_ids.tolist()
        rids = rows.rids
        reqs = rows.reqs
        if sampled.failed:  # a custom processor failed on these rows: they end here, without a token
            for i in sampled.failed:
                ids[i] = NO_TOKEN
            done[list(sampled.failed)] = True
        for req, token in zip(reqs, ids):
            if token != NO_TOKEN:
                req.output_ids.append(token)
        finished: list = [None] * len(ids)
        meta: list = [None] * len(ids)
        headers = self._headers(reqs) if step.mode is ForwardMode.EXTEND else []
        logprobs = self._output_logprobs(rows, sampled) if sampled.logprobs is not None else []
        self.counters["generated_tokens"] += len(ids) - len(sampled.failed)
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
                    self.counters["aborted_requests"] += 1
                else:
                    reason = FinishReason("stop", matched=ids[i]) if stop_list[i] else FinishReason("length", length=n_out)
                    self.counters["finished_requests"] += 1
                finished[i] = req.finished = reason
                meta[i] = self._meta(req)
                self.kv.free_request(req, kv_lens[i], keep=i not in sampled.failed)
                self._finished_hook(req)
            rows.filter(~done, [not d for d in done_list])
        out = BatchTokenOut(rids, ids, finished, meta, headers, logprobs)
        self.send_sock.send(self.send_codec.encode(out))
        if step.mode is ForwardMode.EXTEND and len(rows):
            for req in rows.reqs:
                self.kv.cache_prompt(req)
            self.running.merge(rows)

    def _headers(self, reqs: list[Req]) -> list:
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
            headers.append(RequestHeader(
                req.prompt_len, req.cached_tokens, p.stop, p.min_new_tokens, p.skip_special_tokens,
                p.spaces_between_special_tokens, req.input_logprobs, req.input_top, req.trace_context, req.seq,
            ))  # fmt: skip
        return headers if any(h is not None for h in headers) else []

    @staticmethod
    def _output_logprobs(rows: RunningBatch, sampled: SampleOutput) -> list:
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

    def _prompt_logprobs(self, step: Step, logits: torch.Tensor) -> None:
        """Each prompt token's logprob given the tokens before it, from the prefill's extra rows."""
        logprobs = torch.log_softmax(logits, dim=-1)
        for req, first, count, pos in step.prompt_logprobs:
            targets = torch.tensor(req.input_ids[pos + 1 : pos + 1 + count], dtype=torch.int64, device=logits.device)
            block = logprobs[first : first + count]
            req.input_logprobs += block.gather(1, targets[:, None]).squeeze(1).tolist()
            k = req.top_logprobs_num
            if k:
                values, indices = block.topk(k, dim=-1)
                req.input_top += [TopLogprobs(i, v) for i, v in zip(indices.tolist(), values.tolist())]

    # ------------------------------------------------------------------ prefill

    def _plan_prefill(self) -> list[tuple[Req, int, int]]:
        """Pick (request, tokens already in the pool, tokens to compute now) for a prefill step.

        The budget is chunked_prefill_size tokens (max_prefill_tokens with chunking off, when an
        over-budget prompt still runs whole, alone). Memory: what the step takes plus an estimate of
        every admitted request's new tokens must fit in free plus evictable pool tokens.
        """
        chunk = self.config.chunked_prefill_size
        budget = chunk if chunk > 0 else self.config.max_prefill_tokens
        kv = self.kv
        reserved = int(self.new_token_ratio * self.running.remaining_new_tokens(CLIP_NEW_TOKENS))
        entries: list[tuple[Req, int, int]] = []
        req = in_progress = self.chunked_req  # its prompt is not cached until its last chunk is done
        if req is not None:
            take = min(len(req.fill_ids) - req.kv_len, budget)
            if take > kv.headroom - len(self.running):  # leave the running requests their next token
                return []  # decode steps will finish requests and free memory
            entries.append((req, req.kv_len, take))
            self._planned.append(req)
            budget -= take
            reserved += take
            if req.kv_len + take < len(req.fill_ids):
                return entries
            self.chunked_req = None
        if not self.waiting or budget <= 0:
            return entries
        taken: set[int] = set()
        ordered = order_waiting(self.waiting, self.config.schedule_policy, kv.cache, in_progress)
        if hooks.has("engine_schedule"):
            shown = list(ordered)
            try:
                hooks.call("engine_schedule", waiting=ordered, running=len(self.running))
                ids = [id(r) for r in ordered]
                if len(set(ids)) != len(ids) or not set(ids) <= {id(r) for r in shown}:
                    raise HookError(", ".join(hooks.implementers("engine_schedule")), "engine_schedule",
                                    ValueError("may only reorder or remove the waiting requests"))  # fmt: skip
            except HookError as exc:  # it touched every waiting request it was shown
                self._abort_rids(dict.fromkeys(r.rid for r in shown), str(exc))
                return entries
        for req in ordered:
            if budget <= 0 or not self.req_to_token.available:
                break
            limit = self._never_fits(req)
            if limit is not None:
                taken.add(id(req))
                self._finish_unstarted(req, limit)
                continue
            prefix = kv.lend_prefix(req)  # locked first: a prefix in use is no longer evictable
            ext = len(req.fill_ids) - prefix
            take = min(ext, budget) if chunk > 0 else ext
            if chunk <= 0 and entries and take > budget:
                kv.unlend(req)
                break
            remaining_new = req.sampling.max_new_tokens - len(req.output_ids)
            need = take + int(self.new_token_ratio * min(remaining_new, CLIP_NEW_TOKENS))
            alone = not entries and not len(self.running)
            if need > kv.headroom - reserved and not (alone and take <= kv.headroom):
                kv.unlend(req)
                break
            kv.assign_slot(req)
            if req.admissions == 0:
                req.admitted_ns = time.time_ns()
                req.cached_tokens = min(prefix, req.prompt_len)
                self.counters["prompt_tokens"] += req.prompt_len
            req.admissions += 1
            if hooks.has("engine_request_admitted"):
                try:
                    hooks.call("engine_request_admitted", req=req, cached_tokens=prefix)
                except HookError as exc:  # this request fails alone, before any work
                    kv.free_request(req, req.kv_len)
                    taken.add(id(req))
                    self._finish_unstarted(req, str(exc))
                    continue
            self.counters["cache_hit_tokens"] += prefix
            entries.append((req, prefix, take))
            self._planned.append(req)
            taken.add(id(req))
            budget -= take
            reserved += need
            if take < ext:
                self.chunked_req = req
                break
        if taken:
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        return entries

    def _never_fits(self, req: Req) -> str | None:
        """Why a request can never run here (the user process refuses these up front; this is the guard)."""
        n = req.prompt_len
        if n >= self.context_len:
            return f"the prompt has {n} tokens but context_length is {self.context_len}"
        most = n + req.sampling.max_new_tokens - 1
        if most > self.max_total_tokens:
            return (
                f"the prompt ({n} tokens) plus max_new_tokens needs up to {most} KV tokens but the pool holds "
                f"max_total_tokens={self.max_total_tokens}"
            )
        return None

    def _prefill_step(self, entries: list[tuple[Req, int, int]]) -> Step:
        dev = self.device
        takes = [take for _, _, take in entries]
        total = sum(takes)
        loc = self.kv.alloc(total)
        takes_t = torch.tensor(takes, dtype=torch.int64, device=dev)
        prefix_t = torch.tensor([p for _, p, _ in entries], dtype=torch.int64, device=dev)
        ends = torch.cumsum(takes_t, 0)
        positions = torch.arange(total, device=dev) + torch.repeat_interleave(prefix_t - (ends - takes_t), takes_t)
        slots = torch.tensor([r.slot for r, _, _ in entries], dtype=torch.int64, device=dev)
        self.req_to_token.table[torch.repeat_interleave(slots, takes_t), positions] = loc
        input_ids: list[int] = []
        completing, logits_rows = [], []
        extra_rows: list[int] = []  # prompt logprobs: hidden rows of positions logprob_from .. prompt_len - 2
        prompt_logprobs: list[tuple[Req, int, int, int]] = []
        start = 0
        for i, (req, prefix, take) in enumerate(entries):
            input_ids += req.fill_ids[prefix : prefix + take]
            req.kv_len = prefix + take
            if req.kv_len == len(req.fill_ids):
                completing.append(req)
                logits_rows.append(start + take - 1)
            if req.logprob_from is not None and not req.header_sent:
                lo, hi = max(prefix, req.logprob_from), min(prefix + take, req.prompt_len - 1)
                if hi > lo:
                    prompt_logprobs.append((req, len(extra_rows), hi - lo, lo))
                    extra_rows.extend(range(start + lo - prefix, start + hi - prefix))
            start += take
        self.counters["prefill_steps"] += 1
        self.counters["prefill_tokens"] += total
        if len(completing) < len(entries):
            self.counters["chunked_prefill_steps"] += 1
        seq_lens = prefix_t + takes_t
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=positions,
            out_cache_loc=loc,
            req_slots=slots,
            seq_lens=seq_lens,
            max_seq_len=int(seq_lens.max()),
            logits_indices=torch.tensor(logits_rows + extra_rows, dtype=torch.int64, device=dev),
            extend_lens=takes,
            prefix_lens=[p for _, p, _ in entries],
        )
        rows = RunningBatch(completing, self.model_config.vocab_size, dev)
        return Step(batch, rows, [req for req, _, _ in entries], prompt_logprobs)

    # ------------------------------------------------------------------ decode

    def _decode_step(self) -> Step:
        rows = self.running
        n = len(rows)
        loc = self.kv.alloc(n)
        positions = rows.kv_lens
        self.req_to_token.table[rows.slots, positions] = loc
        rows.kv_lens = positions + 1
        self.counters["decode_steps"] += 1
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=rows.last_ids,
            positions=positions,
            out_cache_loc=loc,
            req_slots=rows.slots,
            seq_lens=rows.kv_lens,
            max_seq_len=int(rows.kv_lens.max()),
            logits_indices=torch.arange(n, device=self.device),
        )
        return Step(batch, rows)

    def _make_room_for_decode(self) -> bool:
        """Ensure one pool token per running request: evict cache, then retract the most recently
        admitted requests (a prompt part-way through chunked prefill first). Returns False when
        nothing is left to decode."""
        kv = self.kv
        rows = self.running
        if kv.headroom >= len(rows):
            return True
        retracted: list[Req] = []
        while kv.headroom < len(rows) * RETRACT_HEADROOM_STEPS and (self.chunked_req is not None or len(rows) > 1):
            if self.chunked_req is not None:
                req, kv_len, self.chunked_req = self.chunked_req, self.chunked_req.kv_len, None
            else:
                req, kv_len = rows.reqs[-1], int(rows.kv_lens[-1])
                keep = [True] * (len(rows) - 1) + [False]
                rows.filter(torch.tensor(keep, device=self.device), keep)
            kv.free_request(req, kv_len)  # its K/V stays in the tree, evictable, for when it resumes
            req.fill_ids = req.all_ids()
            if not req.header_sent:  # a chunked prefill redone from the cache recomputes these
                req.reset_prompt_logprobs()
            retracted.append(req)
        if retracted:
            self.waiting[:0] = retracted[::-1]
            self.counters["retracted_requests"] += len(retracted)
            ratio = self.config.init_new_token_ratio
            self.new_token_ratio = min(1.0, max(ratio, self.new_token_ratio + 0.1))
        if kv.headroom >= len(rows):
            return True
        # one request left and the pool cannot hold its next token (the user process refuses requests
        # that could get here, so this guards a mis-sized pool)
        kv_len = int(rows.kv_lens[0])
        message = f"KV pool exhausted at {kv_len} tokens (max_total_tokens={self.max_total_tokens})"
        self._abort_reqs(rows.reqs, [kv_len], message, keep_kv=True)
        self.running = RunningBatch.empty(self.model_config.vocab_size, self.device)
        return False

    # ------------------------------------------------------------------ failures

    def _schedule_failed(self, message: str) -> None:
        """schedule() raised (a bug, or a plugin's hook): fail the requests it was working on. A prefill
        plan fails the requests it had admitted (they hold slots); a failure before any was admitted
        fails the waiting queue, which would otherwise fail the same way every turn; a decode step
        fails the running batch, whose tensors may be half-updated."""
        traceback.print_exc()
        planned, self._planned = self._planned, []
        if self._phase is ForwardMode.DECODE or not (planned or self.waiting):
            rows = self.running
            self._abort_reqs(rows.reqs, rows.kv_lens.tolist(), message)
            self.running = RunningBatch.empty(self.model_config.vocab_size, self.device)
            return
        if self.chunked_req is not None and any(r is self.chunked_req for r in planned):
            self.chunked_req = None
        if planned:
            ids = {id(r) for r in planned}
            self.waiting = [r for r in self.waiting if id(r) not in ids]
            self._abort_reqs(planned, [r.kv_len for r in planned], message)
            return
        waiting, self.waiting = self.waiting, []
        for req in waiting:
            if req.slot is None:
                self._finish_unstarted(req, message)
            else:
                self._abort_reqs([req], [req.kv_len], message)

    def _abort_step(self, step: Step, message: str) -> None:
        """A step raised: fail every request in it, free their memory (not cached: it may be garbage)."""
        if step.mode is ForwardMode.DECODE:
            rows = step.rows
            self._abort_reqs(rows.reqs, rows.kv_lens.tolist(), message)
            self.running = RunningBatch.empty(self.model_config.vocab_size, self.device)
        else:
            reqs = step.extend_reqs
            if self.chunked_req is not None and any(r is self.chunked_req for r in reqs):
                self.chunked_req = None
            self._abort_reqs(reqs, [r.kv_len for r in reqs], message)

    def _abort_reqs(self, reqs: list[Req], kv_lens: list[int], message: str, keep_kv: bool = False) -> None:
        # a step that failed after some of its requests finished must not free or report those twice
        live = [(r, k) for r, k in zip(reqs, kv_lens) if r.finished is None and r.slot is not None]
        if not live:
            return
        reqs, kv_lens = [r for r, _ in live], [k for _, k in live]
        reason = FinishReason("abort", message=message)
        meta = []
        for req, kv_len in zip(reqs, kv_lens):
            req.finished = reason
            meta.append(self._meta(req))
            self.kv.free_request(req, kv_len, keep=keep_kv)
            self._finished_hook(req)
        n = len(reqs)
        out = BatchTokenOut([r.rid for r in reqs], [NO_TOKEN] * n, [reason] * n, meta)
        self.send_sock.send(self.send_codec.encode(out))
        self.counters["aborted_requests"] += n

    def _abort_rids(self, targets: dict[str, set[int] | None], message: str) -> None:
        """The caller's abort (or the detokenizer's stop string): drop the requests wherever they are,
        keep their valid K/V in the cache, report them finished with reason abort. `targets`: rids, or
        rid -> the seqs meant (None: any)."""

        def meant(r: Req) -> bool:
            if r.rid not in targets:
                return False
            seqs = targets[r.rid]
            return seqs is None or r.seq in seqs

        gone: list[tuple[Req, int]] = [(r, 0) for r in self.waiting if meant(r)]
        if gone:
            self.waiting = [r for r in self.waiting if not meant(r)]
        req = self.chunked_req
        if req is not None and meant(req):
            self.chunked_req = None
            gone.append((req, req.kv_len))
        rows = self.running
        hit = [meant(r) for r in rows.reqs]
        if any(hit):
            kv_lens = rows.kv_lens.tolist()
            gone += [(r, kv_len) for r, kv_len, h in zip(rows.reqs, kv_lens, hit) if h]
            keep = [not h for h in hit]
            rows.filter(torch.tensor(keep, device=self.device), keep)
        if not gone:
            return
        reason = FinishReason("abort", message=message)
        stopped = message == STOP_STRING_MATCHED  # a normal finish the detokenizer saw first
        for req, kv_len in gone:
            req.finished = FinishReason("stop", message=message) if stopped else reason
            if req.slot is not None:
                self.kv.free_request(req, kv_len)
            self._finished_hook(req)
        n = len(gone)
        out = BatchTokenOut([r.rid for r, _ in gone], [NO_TOKEN] * n, [reason] * n, [self._meta(r) for r, _ in gone])
        self.send_sock.send(self.send_codec.encode(out))
        # a stop string is a normal finish that the detokenizer saw first
        self.counters["finished_requests" if message == STOP_STRING_MATCHED else "aborted_requests"] += n

    def _finish_unstarted(self, req: Req, message: str) -> None:
        """Fail a request that never got memory (it holds none)."""
        reason = req.finished = FinishReason("abort", message=message)
        out = BatchTokenOut([req.rid], [NO_TOKEN], [reason], [self._meta(req)])
        self.send_sock.send(self.send_codec.encode(out))
        self.counters["aborted_requests"] += 1
        self._finished_hook(req)

    @staticmethod
    def _finished_hook(req: Req) -> None:
        if hooks.has("engine_request_finished"):
            try:
                hooks.call("engine_request_finished", req=req, finish_reason=req.finished.to_dict())
            except HookError as exc:  # the request is over: report, nothing to fail
                print(f"engine::scheduler: {exc}", file=sys.stderr)

    @staticmethod
    def _meta(req: Req) -> RequestMeta:
        return RequestMeta(req.prompt_len, len(req.output_ids), req.cached_tokens)

    # ------------------------------------------------------------------ stats

    def stats(self, req_id: str, flushed_tokens: int = 0) -> Stats:
        c = self.counters
        return Stats(
            req_id=req_id,
            max_total_tokens=self.max_total_tokens,
            free_tokens=self.kv_pool.available,
            max_running_requests=self.req_to_token.size,
            free_slots=self.req_to_token.available,
            running=len(self.running) + (self.chunked_req is not None),
            waiting=len(self.waiting),
            prefill_steps=c["prefill_steps"],
            decode_steps=c["decode_steps"],
            prompt_tokens=c["prompt_tokens"],
            generated_tokens=c["generated_tokens"],
            finished_requests=c["finished_requests"],
            aborted_requests=c["aborted_requests"],
            stage_seconds=dict(self.busy_seconds),
            prefill_tokens=c["prefill_tokens"],
            chunked_prefill_steps=c["chunked_prefill_steps"],
            cache_hit_tokens=c["cache_hit_tokens"],
            retracted_requests=c["retracted_requests"],
            flushed_tokens=flushed_tokens,
            plugins={"scheduler": _plugin_stats("scheduler")} if hooks.has("engine_stats") else {},
            **self.kv.stats(),
        )


SUPERSEDED = "superseded: a new request reused this rid"


def _abort_targets(message: AbortRequest) -> dict[str, set[int] | None]:
    """rid -> the submission numbers an abort means (None: any; 0 or no seqs given means any)."""
    targets: dict[str, set[int] | None] = {}
    seqs = message.seqs if len(message.seqs) == len(message.rids) else [0] * len(message.rids)
    for rid, seq in zip(message.rids, seqs):
        if seq == 0 or (rid in targets and targets[rid] is None):
            targets[rid] = None
        else:
            targets.setdefault(rid, set()).add(seq)
    return targets


def _plugin_stats(role: str) -> dict:
    try:
        return hooks.call_named("engine_stats", role=role)
    except HookError as exc:
        return {"error": str(exc)}

"""The scheduler: one loop of stages, each a method later hooks and spans attach to.

    recv_requests -> schedule -> forward -> sample -> process_results

Prefill steps (new requests, prompt tokens up to max_prefill_tokens) take priority; otherwise every
running request decodes one token. Requests join and leave the running batch at any step. A request
is admitted only when the pool can hold its prompt plus all its new tokens on top of what the running
requests may still need, so a full pool queues new work and a decode step never runs out of KV.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from engine.config import EngineConfig
from engine.ipc.channels import pull_socket, push_socket
from engine.ipc.messages import (
    BatchTokenOut,
    Codec,
    FinishReason,
    NO_TOKEN,
    GenerateBatch,
    RequestMeta,
    Stats,
    StatsRequest,
    ToDetokenizer,
    ToScheduler,
)
from engine.memory import ReqToTokenPool, TokenKVPool
from engine.model.config import load_hf_config
from engine.model.loader import load_model
from engine.scheduler.batch import RunningBatch
from engine.scheduler.device import pool_size, resolve_device, resolve_dtype
from engine.scheduler.request import Req
from engine.scheduler.sampler import sample
from kernels.attention import ForwardBatch, ForwardMode, create_backend


@dataclass
class Step:
    """One scheduled step: the forward inputs plus the rows (with their sampling tensors) it serves."""

    forward_batch: ForwardBatch
    rows: RunningBatch  # the running batch itself for DECODE; the newly admitted requests for EXTEND

    @property
    def mode(self) -> ForwardMode:
        return self.forward_batch.mode


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
        self.waiting: collections.deque[Req] = collections.deque()
        self.running = RunningBatch.empty(mc.vocab_size, self.device)
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
            self.run_once()

    def run_once(self, block: bool = True) -> bool:
        """One turn of the loop: receive (blocking only if idle and `block`), then at most one step.
        Returns whether a step ran.

        A step that raises fails only the requests in it (finish reason "abort" with the error);
        the engine keeps serving the rest.
        """
        clock = time.perf_counter
        busy = self.busy_seconds
        self.recv_requests(block=block and not (self.waiting or len(self.running)))
        t0 = clock()
        step = self.schedule()
        if step is None:
            return False
        t1 = clock()
        try:
            logits = self.forward(step)
            t2 = clock()
            next_ids = self.sample(step, logits)
            t3 = clock()
            self.process_results(step, next_ids)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            self._abort_step(step, f"{type(exc).__name__}: {exc}")
            return True
        t4 = clock()
        busy["schedule"] += t1 - t0
        busy[f"forward_{step.mode.value}"] += t2 - t1
        busy["sample"] += t3 - t2
        busy["process_results"] += t4 - t3
        return True

    def close(self) -> None:
        """Close the sockets (the process exits without this; in-process users such as tests need it)."""
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
        self.zmq_ctx.term()

    # ------------------------------------------------------------------ stages

    def recv_requests(self, block: bool) -> None:
        """Drain the request socket; when nothing runs, block on it (no spinning on an idle machine)."""
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
            if isinstance(message, GenerateBatch):
                eos = self.model_config.eos_token_ids
                self.waiting.extend(Req(r.rid, r.input_ids, r.sampling, eos) for r in message.reqs)
            elif isinstance(message, StatsRequest):
                self.send_sock.send(self.send_codec.encode(self.stats(message.req_id)))

    def schedule(self) -> Step | None:
        """Admit waiting requests into a prefill step if any fit, else decode the running batch."""
        admitted = self._admit()
        if admitted:
            return self._prefill_step(admitted)
        if len(self.running):
            return self._decode_step()
        return None

    def forward(self, step: Step) -> torch.Tensor:
        return self.model(step.forward_batch, self.backend)

    def sample(self, step: Step, logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, step.rows.sampling)

    def process_results(self, step: Step, next_ids: torch.Tensor) -> None:
        """Append each row's token, finish rows that hit a stop token or their length, emit one message."""
        rows = step.rows
        rows.last_ids = next_ids
        rows.out_lens = rows.out_lens + 1
        hit_stop = (next_ids[:, None] == rows.stop_table).any(dim=1)
        done = hit_stop | (rows.out_lens >= rows.max_new)
        ids = next_ids.tolist()
        rids = rows.rids
        for req, token in zip(rows.reqs, ids):
            req.output_ids.append(token)
        finished: list = [None] * len(ids)
        meta: list = [None] * len(ids)
        self.counters["generated_tokens"] += len(ids)
        if bool(done.any()):
            done_list = done.tolist()
            stop_list = hit_stop.tolist()
            kv_lens = rows.kv_lens.tolist()
            released = []
            for i, is_done in enumerate(done_list):
                if not is_done:
                    continue
                req = rows.reqs[i]
                n_out = len(req.output_ids)
                reason = FinishReason("stop", matched=ids[i]) if stop_list[i] else FinishReason("length", length=n_out)
                finished[i] = req.finished = reason
                meta[i] = RequestMeta(prompt_tokens=req.prompt_len, completion_tokens=n_out)
                released.append((req.slot, kv_lens[i]))
                self.counters["finished_requests"] += 1
            self._release(released)
            rows.filter(~done, [not d for d in done_list])
        self.send_sock.send(self.send_codec.encode(BatchTokenOut(rids, ids, finished, meta)))
        if step.mode is ForwardMode.EXTEND and len(rows):
            self.running.merge(rows)

    # ------------------------------------------------------------------ helpers

    def _admit(self) -> list[Req]:
        if not self.waiting:
            return []
        budget = self.config.max_prefill_tokens
        available = self.kv_pool.available - self.running.remaining_kv()
        admitted: list[Req] = []
        tokens = 0
        while self.waiting and self.req_to_token.available:
            req = self.waiting[0]
            if req.max_tokens > available or (admitted and tokens + req.prompt_len > budget):
                break
            self.waiting.popleft()
            req.slot = self.req_to_token.alloc()
            available -= req.max_tokens
            tokens += req.prompt_len
            admitted.append(req)
        return admitted

    def _prefill_step(self, reqs: list[Req]) -> Step:
        dev = self.device
        lens = [r.prompt_len for r in reqs]
        total = sum(lens)
        loc = self.kv_pool.alloc(total)
        assert loc is not None, "admission guaranteed room for the prompts"
        lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
        ends = torch.cumsum(lens_t, 0)
        starts = ends - lens_t
        positions = torch.arange(total, device=dev) - torch.repeat_interleave(starts, lens_t)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.int64, device=dev)
        self.req_to_token.table[torch.repeat_interleave(slots, lens_t), positions] = loc
        for r in reqs:
            r.kv_len = r.prompt_len
        self.counters["prefill_steps"] += 1
        self.counters["prompt_tokens"] += total
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for r in reqs for t in r.input_ids], dtype=torch.int64, device=dev),
            positions=positions,
            out_cache_loc=loc,
            req_slots=slots,
            seq_lens=lens_t,
            max_seq_len=max(lens),
            logits_indices=ends - 1,
            extend_lens=lens,
            prefix_lens=[0] * len(reqs),
        )
        return Step(batch, RunningBatch(reqs, self.model_config.vocab_size, dev))

    def _decode_step(self) -> Step:
        rows = self.running
        n = len(rows)
        loc = self.kv_pool.alloc(n)
        assert loc is not None, "admission reserved room for every running request's new tokens"
        positions = rows.kv_lens
        self.req_to_token.table[rows.slots, positions] = loc
        rows.kv_lens = positions + 1
        self.counters["decode_steps"] += 1
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

    def _abort_step(self, step: Step, message: str) -> None:
        rows = step.rows
        kv_lens = rows.kv_lens.tolist()
        reason = FinishReason("abort", message=message)
        meta = []
        for req in rows.reqs:
            req.finished = reason
            meta.append(RequestMeta(prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids)))
        self._release([(req.slot, kv_len) for req, kv_len in zip(rows.reqs, kv_lens)])
        n = len(rows.reqs)
        out = BatchTokenOut(list(rows.rids), [NO_TOKEN] * n, [reason] * n, meta)
        self.send_sock.send(self.send_codec.encode(out))
        self.counters["aborted_requests"] += n
        if step.mode is ForwardMode.DECODE:
            self.running = RunningBatch.empty(self.model_config.vocab_size, self.device)

    def _release(self, finished: list[tuple[int, int]]) -> None:
        """Return (slot, kv_len) pairs' pool tokens in one free-list update, and their slots."""
        if not finished:
            return
        table = self.req_to_token.table
        self.kv_pool.free(torch.cat([table[slot, :kv_len] for slot, kv_len in finished]))
        for slot, _ in finished:
            self.req_to_token.free(slot)

    def stats(self, req_id: str) -> Stats:
        c = self.counters
        return Stats(
            req_id=req_id,
            max_total_tokens=self.max_total_tokens,
            free_tokens=self.kv_pool.available,
            max_running_requests=self.req_to_token.size,
            free_slots=self.req_to_token.available,
            running=len(self.running),
            waiting=len(self.waiting),
            prefill_steps=c["prefill_steps"],
            decode_steps=c["decode_steps"],
            prompt_tokens=c["prompt_tokens"],
            generated_tokens=c["generated_tokens"],
            finished_requests=c["finished_requests"],
            aborted_requests=c["aborted_requests"],
            stage_seconds=dict(self.busy_seconds),
        )

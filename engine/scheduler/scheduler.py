"""The scheduler: one loop of stages, each a method that hooks, spans and profiles see by name, each
implemented in a module of its own:

    recv_requests   receive.py          drain the socket, check and queue arrivals, aborts
    schedule        schedule.py         a prefill (prefill.py) or a decode step (decode.py), making
                                        room under memory pressure first (memory_pressure.py)
    forward         execute.py          the model
    sample          execute.py          one token per row (engine/sampling)
    process_results results.py          append, finish, emit
                    endings.py          failed steps, aborts, requests that never start
                    stats.py            the counters

A step is either a prefill (EXTEND: new requests' prompts after their cached prefix, up to a token
budget, the last one possibly cut into a chunk) or a decode (every running request, one token).
Prefill goes first, except that while a prompt is being prefilled chunk by chunk, decode steps
alternate with its chunks so running requests keep producing tokens.
"""

from __future__ import annotations

import collections
import logging
import time
import traceback

import torch
import zmq

from engine import hooks
from engine.beam_search.batch import BeamBatch
from engine.config import EngineConfig
from engine.cores import usable_cores
from engine.grammar.stage import Grammars
from engine.hooks import HookError
from engine.hooks.types import StepRecord
from engine.ipc.channels import pull_socket, push_socket
from engine.ipc.inbox import Inbox
from engine.ipc.messages import Codec, Stats, ToDetokenizer, ToScheduler
from engine.memory import ReqToTokenPool, TokenKVPool
from engine.memory.manager import KVManager
from engine.model.config import load_hf_config
from engine.model.loader import kernel_info, load_model
from engine.quantization import check_quantization, resolve_device_for, resolve_dtype_for
from engine.sampling.processors import ProcessorSet
from engine.sampling.sampler import SampleOutput
from engine.scheduler import endings, execute, receive, results
from engine.scheduler import schedule as schedule_stage
from engine.scheduler import stats as stats_stage
from engine.scheduler.batch import RunningBatch
from engine.scheduler.device import pool_size, resolve_device, resolve_dtype
from engine.scheduler.request import Req
from engine.scheduler.step import Step
from engine.kernels.attention import create_backend
from engine.model.forward_batch import ForwardMode

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, config: EngineConfig, model_dir: str, endpoints: dict, progress=None
    ) -> None:
        torch.set_num_threads(config.num_threads or usable_cores())
        self.config = config
        self.device = resolve_device(resolve_device_for(config.quantization, config.device))
        self.dtype = resolve_dtype(
            resolve_dtype_for(config.quantization, config.dtype), self.device
        )
        check_quantization(config.quantization, self.device, self.dtype)
        hf_config = load_hf_config(model_dir)
        max_pos = hf_config.max_position_embeddings
        if (
            config.context_length is not None and config.context_length > max_pos
        ):  # not cut down unseen
            raise ValueError(
                f"context_length={config.context_length} is more than the model's "
                f"max_position_embeddings ({max_pos})"
            )
        self.context_len = config.context_length or max_pos
        self.model, self.model_config = load_model(
            model_dir,
            hf_config,
            self.dtype,
            self.device,
            self.context_len,
            progress,
            config.quantization,
            config.kernel_overrides,
        )
        mc = self.model_config
        bytes_per_token = TokenKVPool.bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        cap = config.max_running_requests * self.context_len
        self.max_total_tokens = pool_size(
            config.max_total_tokens, config.mem_fraction, bytes_per_token, self.device, cap
        )
        self.req_to_token = ReqToTokenPool(
            config.max_running_requests, self.context_len, self.device
        )
        self.kv_pool = TokenKVPool(
            self.max_total_tokens,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        self.kv = KVManager(
            self.kv_pool, self.req_to_token, config.enable_prefix_cache, self.device
        )
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
        self.inbox = Inbox(self.recv_sock, Codec(ToScheduler), "engine::scheduler")
        self.send_codec = Codec(ToDetokenizer)
        self.waiting: list[Req] = []
        self.running = RunningBatch.empty(mc.vocab_size, self.device)
        self.beams = BeamBatch(
            mc.vocab_size, self.device, self.req_to_token.table
        )  # live beam searches
        self.grammars = Grammars(
            model_dir, mc.vocab_size, list(mc.eos_token_ids)
        )  # structured output
        self.chunked_req: Req | None = None  # a prompt part-way through a chunked prefill
        self._planned: list[
            Req
        ] = []  # requests the schedule now running has admitted (to fail if it raises)
        self._phase = ForwardMode.EXTEND  # which half of schedule() is running
        self.last_mode: ForwardMode | None = None
        self.new_token_ratio = config.init_new_token_ratio
        self.processors = ProcessorSet()
        self.counters = collections.Counter()
        self.busy_seconds: collections.Counter = (
            collections.Counter()
        )  # wall time per stage, since start
        self.info = {
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": config.quantization,
            "max_total_tokens": self.max_total_tokens,
            "max_running_requests": config.max_running_requests,
            "context_length": self.context_len,
            "vocab_size": mc.vocab_size,
            "architecture": mc.architecture,
            "eos_token_ids": list(mc.eos_token_ids),
            "kv_bytes_per_token": bytes_per_token,
            # the choice table's pick for each kind of linear layer, their classes, the decode path
            **kernel_info(self.model),
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
                time.sleep(
                    0.001
                )  # requests wait but none could start (a plugin holds them back): no hot spin

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
        idle = not (self.waiting or len(self.running) or self.chunked_req or self.beams)
        self.recv_requests(block=block and idle)
        t0 = clock()
        try:
            step = self.schedule()
        except Exception as exc:  # noqa: BLE001 - fail what the schedule touched, never the process
            endings.schedule_failed(self, f"{type(exc).__name__}: {exc}")
            return True
        self._planned = []  # only a failing schedule() needs them; kept, they would outlive their requests
        if step is None:
            return False
        t1 = clock()
        t2 = t3 = None
        reqs = step.reqs  # kept: finishing requests leave step.rows
        try:
            logits = self.forward(step)
            t2 = clock()
            sampled = self.sample(step, logits)
            t3 = clock()
            self.process_results(step, sampled)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            message = f"{type(exc).__name__}: {exc}"
            endings.abort_step(self, step, message)
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
        record = StepRecord(
            mode, reqs, int(step.forward_batch.input_ids.numel()), t0, t1, t2, t3, t4, error
        )
        try:
            hooks.call("engine_step_end", step=record)
        except HookError as exc:  # the step is over: report, nothing to fail
            logger.error("engine::scheduler: %s", exc)

    def close(self) -> None:
        """Close the sockets (the process exits without this; in-process users such as tests need it)."""
        self.grammars.close()
        self.recv_sock.close(linger=0)
        self.send_sock.close(linger=0)
        self.zmq_ctx.term()

    # ------------------------------------------------------------------ stages (each in its own module)

    def recv_requests(self, block: bool) -> None:
        receive.recv_requests(self, block)

    def schedule(self) -> Step | None:
        return schedule_stage.schedule(self)

    def forward(self, step: Step) -> torch.Tensor:
        return execute.forward(self, step)

    def sample(self, step: Step, logits: torch.Tensor) -> SampleOutput | None:
        return execute.sample(self, step, logits)

    def process_results(self, step: Step, sampled: SampleOutput | None) -> None:
        results.process_results(self, step, sampled)

    def stats(self, req_id: str, flushed_tokens: int = 0) -> Stats:
        return stats_stage.stats(self, req_id, flushed_tokens)

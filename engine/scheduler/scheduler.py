"""The scheduler: one loop of stages, each a method that hooks, spans and profiles see by name, each
implemented in a module of its own over the state's owners (state.py), never over the Scheduler:

    recv_requests   receive.py          drain the socket, check and queue arrivals, aborts
    schedule        schedule.py         a prefill (prefill.py) or a decode step (decode.py), making
                                        room under memory pressure first (memory_pressure.py)
    forward         model_runner.py     the model (execute.py adds the forward hooks)
    sample          execute.py          one token per row (engine/sampling)
    process_results results.py          append, finish, emit
                    endings.py          failed steps, aborts, requests that never start
                    stats.py            the counters

The owners: the waiting queue (waiting.py), the running batch (batch.py), the live beam searches
(engine/beam_search), the memory (engine/memory: pool, prefix cache, request slots), the schedule
plan (plan.py: the chunked prompt, the admission estimate), structured output's grammars, the outbox
to the detokenizer, and the counters.

A step is either a prefill (EXTEND: new requests' prompts after their cached prefix, up to a token
budget, the last one possibly cut into a chunk) or a decode (every running request, one token).
Prefill goes first, except that while a prompt is being prefilled chunk by chunk, decode steps
alternate with its chunks so running requests keep producing tokens.

Under tensor parallelism every rank runs this loop: rank 0 shares each turn's messages
(engine/distributed/turns.py), every rank schedules, runs its shard of the model and samples alike,
and only rank 0 talks to the detokenizer (docs/tensor-parallel.md).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import TYPE_CHECKING

import torch
import zmq

from engine import hooks
from engine.config import EngineConfig
from engine.cores import usable_cores
from engine.ipc.channels import pull_socket, push_socket
from engine.ipc.inbox import Inbox
from engine.ipc.messages import Codec, Stats, ToScheduler
from engine.model.loader import kernel_info
from engine.sampling.sampler import SampleOutput
from engine.scheduler import endings, execute, layer_taps, receive, results
from engine.scheduler import schedule as schedule_stage
from engine.scheduler import stats as stats_stage
from engine.scheduler.model_runner import ModelRunner
from engine.scheduler.outbox import Outbox
from engine.scheduler.state import SchedulerState
from engine.scheduler.step import Step, step_end_hook

if TYPE_CHECKING:
    from engine.distributed.group import TPGroup


class Scheduler:
    """The loop over the stages; the model runner runs the model, `state` holds what the stages change."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        endpoints: dict,
        progress=None,
        rank: int = 0,
        dist_init_addr: str | None = None,
    ) -> None:
        """rank, dist_init_addr: this process's tensor-parallel rank and the ranks' rendezvous
        (tp_size > 1 only); ranks share the machine's cores."""
        self.group = group = None
        if config.tp_size > 1:  # torch.distributed is imported only here
            from engine.distributed.group import TPGroup
            from engine.distributed.turns import TurnSocket

            self.group = group = TPGroup(rank, config.tp_size, dist_init_addr)
            config = _rank0_config(config, group)
            # unseeded sampling: the same draws on every rank
            torch.manual_seed(group.shared_seed())
        local_ranks = config.tp_size // config.nnodes
        torch.set_num_threads(config.num_threads or max(1, usable_cores() // local_ranks))
        self.config = config
        self.runner = runner = ModelRunner(config, model_dir, progress, group)
        mc = runner.model_config
        self.zmq_ctx = self.recv_sock = self.send_sock = None
        if rank == 0:
            self.zmq_ctx = zmq.Context(1)
            self.recv_sock = pull_socket(self.zmq_ctx, endpoints["scheduler"])
            self.send_sock = push_socket(self.zmq_ctx, endpoints["detokenizer"])
        arrivals = self.recv_sock if group is None else TurnSocket(self.recv_sock, group)
        self.inbox = Inbox(arrivals, Codec(ToScheduler), "engine::scheduler")
        self.state = SchedulerState.build(config, runner, model_dir, Outbox(self.send_sock))
        self.info = {
            "device": runner.device,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "quantization": config.quantization,
            "max_total_tokens": runner.max_total_tokens,
            "max_running_requests": config.max_running_requests,
            "context_length": runner.context_len,
            "vocab_size": mc.vocab_size,
            "num_layers": mc.num_layers,
            "hidden_size": mc.hidden_size,
            "architecture": mc.architecture,
            "eos_token_ids": list(mc.eos_token_ids),
            "kv_bytes_per_token": runner.bytes_per_token,
            # the choice table's pick for each kind of linear layer, their classes, the decode path
            **kernel_info(runner.model),
        }
        if group is not None:
            self.info["tp_size"] = group.size
        if config.reduce_like_tp > 1:  # summed like that many ranks (engine/linear/shard_sums.py)
            self.info["reduce_like_tp"] = config.reduce_like_tp

    # ------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        while True:
            try:
                ran = self.run_once()
            except Exception:  # noqa: BLE001 - the last guard: report, keep serving the other requests
                traceback.print_exc()
                ran = False
                time.sleep(0.01)
            if not ran and self.state.waiting:
                # requests wait but none could start (a plugin holds them back): no hot spin
                time.sleep(0.001)

    @torch.inference_mode()
    def run_once(self, block: bool = True) -> bool:
        """One turn of the loop: receive (blocking only if idle and `block`), then at most one step.
        Returns whether a step ran.

        A step that raises fails only the requests in it (finish reason "abort" with the error);
        the engine keeps serving the rest. Everything runs in inference mode: the batch's tensors
        are created and updated in place from one step to the next.
        """
        clock = time.perf_counter
        state = self.state
        self.recv_requests(block=block and state.idle())
        t0 = clock()
        try:
            step = self.schedule()
        except Exception as exc:  # noqa: BLE001 - fail what the schedule touched, never the process
            endings.schedule_failed(state, f"{type(exc).__name__}: {exc}")
            return True
        state.plan.take_planned()  # only a failing schedule() needs them
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
            layer_taps.fail_tapped(state, step)
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            message = f"{type(exc).__name__}: {exc}"
            endings.abort_step(state, step, message)
            if hooks.has("engine_step_end"):
                step_end_hook(step, reqs, (t0, t1, t2, t3, clock()), message)
            return True
        t4 = clock()
        busy = state.busy_seconds
        busy["schedule"] += t1 - t0
        busy[f"forward_{step.mode.value}"] += t2 - t1
        busy["sample"] += t3 - t2
        busy["process_results"] += t4 - t3
        if hooks.has("engine_step_end"):
            step_end_hook(step, reqs, (t0, t1, t2, t3, t4), None)
        return True

    def close(self) -> None:
        """Close the sockets (the process exits without this; in-process users such as tests need it)."""
        self.state.grammars.close()
        if self.group is not None:
            self.group.close()
        if self.zmq_ctx is not None:
            self.recv_sock.close(linger=0)
            self.send_sock.close(linger=0)
            self.zmq_ctx.term()

    # ------------------------------------------------------------------ stages (each in its own module)

    def recv_requests(self, block: bool) -> None:
        receive.recv_requests(self.state, self.inbox, block)

    def schedule(self) -> Step | None:
        step = schedule_stage.schedule(self.state)
        if step is not None:
            layer_taps.attach(self.state, step)
        return step

    def forward(self, step: Step) -> torch.Tensor:
        return execute.forward(self.runner, step)

    def sample(self, step: Step, logits: torch.Tensor) -> SampleOutput | None:
        return execute.sample(self.state, step, logits)

    def process_results(self, step: Step, sampled: SampleOutput | None) -> None:
        results.process_results(self.state, step, sampled)

    def stats(self, req_id: str, flushed_tokens: int = 0) -> Stats:
        return stats_stage.stats(self.state, req_id, flushed_tokens)


def _rank0_config(config: EngineConfig, group: TPGroup) -> EngineConfig:
    """Rank 0's settings on every rank (another machine's ranks start knowing only where to meet):
    the same limits and policies, or the ranks would schedule apart."""
    shared = group.share_bytes([config.to_json()] if group.rank == 0 else None)[0]
    return dataclasses.replace(EngineConfig.from_json(shared), node_rank=config.node_rank)

"""TokenizerManager (user process): tokenize and validate, send to the scheduler, collect text results.

It composes the parts that do each job: the request table (request_table.py), the send socket
(scheduler_channel.py), submission (submission.py, with layer_checks.py), aborts (aborts.py), the
scheduler questions (scheduler_queries.py), and the receiver thread (receiver.py) whose outputs
output_dispatch.py hands to the waiting requests.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import zmq

from engine import hooks
from engine.frontend.aborts import Aborts
from engine.frontend.layer_checks import LayerChecks
from engine.frontend.output_dispatch import OutputDispatch
from engine.frontend.receiver import Receiver
from engine.frontend.request_state import ReqState
from engine.frontend.request_table import RequestTable
from engine.frontend.scheduler_channel import SchedulerChannel
from engine.frontend.scheduler_queries import SchedulerQueries
from engine.frontend.submission import Submission
from engine.frontend.tokenize_stage import tokenize_stage
from engine.hooks.types import PromptRequest
from engine.ipc.channels import Endpoints, pull_socket, push_socket

logger = logging.getLogger(__name__)


class TokenizerManager:
    def __init__(self, tokenizer, endpoints: Endpoints) -> None:
        self.tokenizer = tokenizer
        self.zmq_ctx = zmq.Context(1)
        self.receiver = Receiver(pull_socket(self.zmq_ctx, endpoints.tokenizer))
        self.channel = SchedulerChannel(push_socket(self.zmq_ctx, endpoints.scheduler))
        self.requests = RequestTable()
        self.aborts = Aborts(self.requests, self.channel, self.receiver.wake)
        self.queries = SchedulerQueries(self.requests, self.channel, self.aborts.queued)
        self.dispatch = OutputDispatch(self.requests, self.queries)
        self.layers = LayerChecks()
        self.submission = Submission(
            self.tokenize, self.requests, self.channel, self.layers, len(tokenizer)
        )
        self.model = ""  # this engine's model name: its requests carry it (PromptRequest.model)

    @property
    def dead(self) -> str | None:
        """Why this engine serves no more requests, or None while it does."""
        return self.requests.dead

    # ------------------------------------------------------------------ life cycle

    def start(self, sentinels: dict[int, str], info: dict, on_dead: Callable[[str], None]) -> None:
        """Begin receiving; `sentinels` maps each child's process sentinel fd to its role."""
        self.submission.configure(info)
        self.model = str(info.get("model", ""))
        self.layers.configure(info)

        def died(reason: str) -> None:
            self.dispatch.fail_all(reason)
            on_dead(reason)

        self.receiver.start(sentinels, self.dispatch.dispatch, self.aborts.send_deferred, died)

    def close(self, reason: str = "the engine was shut down") -> None:
        """Fail what waits, stop the receiver thread, then close the sockets: the send socket under the
        send lock (a racing submit then gets EngineDeadError), the receive socket only once the thread
        that reads it has stopped."""
        self.dispatch.fail_all(reason)
        stopped = self.receiver.stop()
        self.channel.close()
        # stuck in a caller's listener: leave its socket be
        if not stopped:
            logger.warning("engine: the receiver thread did not stop; its socket is left open")
            return
        self.receiver.close()
        self.zmq_ctx.term()

    # ------------------------------------------------------------------ stages

    def tokenize(
        self, prompt=None, input_ids=None, messages=None
    ) -> tuple[list[list[int]], bool, list[PromptRequest]]:
        """The tokenize stage (engine/frontend/tokenize_stage.py) for this engine's tokenizer and model."""
        return tokenize_stage(self.tokenizer, self.model, prompt, input_ids, messages)

    def submit(self, *args: Any, **kwargs: Any) -> tuple[list[ReqState], bool]:
        """Submission.submit: the call checked in full, then sent in one message (nothing on error)."""
        return self.submission.submit(*args, **kwargs)

    def wait(self, states: list[ReqState]) -> list[dict]:
        try:
            for state in states:
                state.done.wait()
        except BaseException:  # Ctrl-C in the caller: its requests must not run on
            self.aborts.abort_requests(states)
            raise
        return [self.output(s.result(), s.seq) for s in states]

    @staticmethod
    def output(result: dict, seq: int) -> dict:
        """The output stage: a finished result passes the output hook before the caller gets it. If
        the hook fails, that result (only) comes back marked aborted, with the plugin's error."""
        if hooks.has("engine_output"):
            try:
                hooks.call("engine_output", result=result, seq=seq)
            except hooks.HookError as exc:
                result["meta_info"]["finish_reason"] = {"type": "abort", "message": str(exc)}
        return result

    # ------------------------------------------------------------------ the parts' public calls

    def abort(self, rids: list[str], message: str = "aborted by the caller") -> None:
        self.aborts.abort(rids, message)

    def abort_soon(self, states: list[ReqState], message: str = "aborted by the caller") -> None:
        self.aborts.abort_soon(states, message)

    def get_stats(self, timeout: float = 30.0) -> dict:
        return self.queries.get_stats(timeout)

    def flush_cache(self, timeout: float = 30.0) -> dict:
        return self.queries.flush_cache(timeout)

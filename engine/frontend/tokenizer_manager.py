"""TokenizerManager (user process): tokenize and validate, send to the scheduler, collect text results.

A receiver thread reads the detokenizer's outputs and the children's process sentinels in one zmq poll,
so a child's death is noticed at once and every waiting caller gets EngineDeadError.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable

import msgspec
import zmq

from engine import hooks
from engine.beam_search.params import beam_problem
from engine.errors import EngineDeadError
from engine.frontend.request_checks import (
    check_call_size,
    check_logprob_options,
    check_unique_rids,
    malformed_text_message,
)
from engine.frontend.request_state import ReqState
from engine.frontend.tokenize_stage import tokenize_stage
from engine.hooks.types import PromptRequest
from engine.ipc.channels import MAX_MESSAGE_BYTES, Endpoints, pull_socket, push_socket
from engine.taps.checks import layer_request, size_problem
from engine.taps.registry import TapRegistry
from engine.taps.spec import LayerRequest
from engine.ipc.inbox import Inbox
from engine.ipc.messages import (
    AbortRequest,
    BatchTextOut,
    BeamParams,
    BeamTextOut,
    Codec,
    FinishReason,
    FlushCache,
    GenerateBatch,
    RequestMeta,
    Stats,
    StatsRequest,
    TokenizedRequest,
    ToScheduler,
    ToTokenizer,
)
from engine.sampling.processors import get_logit_processor
from engine.sampling_params import SamplingParams, copy_seed, parse_sampling_params
from engine.tracing.context import normalize_trace_context

logger = logging.getLogger(__name__)


def _done_hook(state: "ReqState", error: str | None) -> None:
    """engine_request_done, from the receiver thread: a plugin error is logged, never raised there."""
    try:
        hooks.call(
            "engine_request_done",
            rid=state.rid,
            meta_info=state.meta_info(),
            error=error,
            seq=state.seq,
        )
    except BaseException as exc:  # noqa: BLE001 - the receiver must go on, or callers hang
        logger.error("engine: %s", exc)


_SEQ = itertools.count(1)


def _names(states: list[ReqState]) -> list[str]:
    """What a call's requests take while they run: their rids, and each n > 1 prompt's rid."""
    return [s.rid for s in states] + sorted({s.group for s in states if s.group is not None})


def _not_sent(announced: list[TokenizedRequest], exc: BaseException) -> None:
    """The call failed after engine_request_submitted saw these requests: they end here, unsent."""
    if not announced or not hooks.has("engine_request_done"):
        return
    for req in announced:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": None,
        }
        try:
            hooks.call(
                "engine_request_done",
                rid=req.rid,
                meta_info=meta,
                error=f"not sent: {type(exc).__name__}: {exc}",
                seq=req.seq,
            )
        except BaseException as hook_exc:  # noqa: BLE001 - the caller gets the original error
            logger.error("engine: %s", hook_exc)


class TokenizerManager:
    def __init__(self, tokenizer, endpoints: Endpoints) -> None:
        self.tokenizer = tokenizer
        self.zmq_ctx = zmq.Context(1)
        self.recv_sock = pull_socket(self.zmq_ctx, endpoints.tokenizer)
        self.send_sock = push_socket(self.zmq_ctx, endpoints.scheduler)
        # wakes the receiver thread: to stop, or to send aborts queued where no lock may be taken
        # (finalizers). A pipe, because any thread may write it; a zmq socket is for one thread at a time.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # only ever tried, never waited on
        self._deferred: collections.deque = collections.deque()  # (states, message) from abort_soon
        self._stopping = False
        self._seq = _SEQ  # one count for every engine of the process: (rid, seq) names one request
        self.send_codec = Codec(ToScheduler)
        self.inbox = Inbox(
            self.recv_sock, Codec(ToTokenizer), "engine::tokenizer_manager", malformed_text_message
        )
        self.send_lock = threading.Lock()
        self.states: dict[str, ReqState] = {}
        self.states_lock = threading.Lock()
        self.pending_stats: dict[str, list] = {}
        self.groups: dict[
            str, list[ReqState]
        ] = {}  # rid given for n > 1 -> its copies, while any runs
        self.dead: str | None = None
        self.vocab_size = len(tokenizer)
        self.context_length = 0
        self.max_total_tokens = 0
        self.max_running_requests = 0
        self.max_sequences_per_call = 0
        self.taps = TapRegistry(0, 0)  # the model's layers and plugins' taps, known at start
        self.max_hidden_state_bytes = 0
        self.model = ""  # this engine's model name: its requests carry it (PromptRequest.model)
        # rids of calls between their clash check and registration: checked and taken under
        # states_lock, so two calls giving one rid at once never both reach the submit hooks
        self._reserved: set[str] = set()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self, sentinels: dict[int, str], info: dict, on_dead: Callable[[str], None]) -> None:
        """Begin receiving; `sentinels` maps each child's process sentinel fd to its role."""
        self.context_length = info["context_length"]
        self.max_total_tokens = info["max_total_tokens"]
        self.max_running_requests = info["max_running_requests"]
        self.max_sequences_per_call = info["max_sequences_per_call"]
        self.vocab_size = info["vocab_size"]  # the model's, which may exceed the tokenizer's
        self.model = str(info.get("model", ""))
        self.taps = TapRegistry(info["num_layers"], info["hidden_size"])
        self.max_hidden_state_bytes = info["max_hidden_state_bytes"]
        self._on_dead = on_dead
        self._thread = threading.Thread(
            target=self._recv_loop, args=(sentinels,), name="engine-recv", daemon=True
        )
        self._thread.start()

    def close(self, reason: str = "the engine was shut down") -> None:
        """Fail what waits, stop the receiver thread, then close the sockets: the send socket under the
        send lock (a racing submit then gets EngineDeadError), the receive socket only once the thread
        that reads it has stopped."""
        self._mark_dead(reason)
        self._stopping = True
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        with self.send_lock:
            self.send_sock.close(linger=0)
        # stuck in a caller's listener: leave its socket be
        if thread is not None and thread.is_alive():
            logger.warning("engine: the receiver thread did not stop; its socket is left open")
            return
        self.recv_sock.close(linger=0)
        self.zmq_ctx.term()
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_w = -1

    def _wake(self) -> None:
        """Wake the receiver thread. Never blocks: safe in a finalizer, under any lock."""
        if self._wake_lock.acquire(blocking=False):
            try:
                if self._wake_w >= 0:
                    os.write(self._wake_w, b"x")
            except OSError:  # the pipe is full: the thread is awake already
                pass
            finally:
                self._wake_lock.release()

    def _mark_dead(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        with self.states_lock:
            states, self.states, self.groups = list(self.states.values()), {}, {}
            stats, self.pending_stats = list(self.pending_stats.values()), {}
        done_hook = hooks.has("engine_request_done")
        for state in states:
            state.error = EngineDeadError(self.dead)
            state.finished_at = time.perf_counter()
            if done_hook:
                _done_hook(state, self.dead)
            state.done.set()
            if state.listener is not None:
                with contextlib.suppress(Exception):
                    state.listener(state, None, None)
        for holder in stats:
            holder[1] = EngineDeadError(self.dead)
            holder[0].set()

    def _recv_loop(self, sentinels: dict[int, str]) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                with contextlib.suppress(OSError):
                    while os.read(self._wake_r, 4096):
                        pass
                if self._stopping:
                    return
                self._send_deferred()
            for fd, role in sentinels.items():
                if fd in events:
                    reason = f"the {role} process died; this engine can serve no more requests"
                    self._mark_dead(reason)
                    self._on_dead(reason)
                    return
            if self.recv_sock in events:
                try:
                    for message in self.inbox.drain():
                        self._dispatch(message)
                except Exception as exc:  # noqa: BLE001 - a dead receiver would leave every caller waiting
                    reason = (
                        f"the tokenizer manager's receiver failed ({type(exc).__name__}: {exc})"
                    )
                    self._mark_dead(reason)
                    self._on_dead(reason)
                    return

    def _dispatch(self, message) -> None:
        if isinstance(message, BeamTextOut):
            state = self.states.get(message.rid)
            if state is not None:
                state.beam_out = message
                self._finish(
                    state,
                    message.hypotheses[0].finish
                    if message.hypotheses
                    else FinishReason("length", length=0),
                    message.meta,
                    time.perf_counter(),
                )
                if state.listener is not None:
                    with contextlib.suppress(Exception):
                        state.listener(state, "", [])
            return
        if isinstance(message, Stats):
            with self.states_lock:
                holder = self.pending_stats.pop(message.req_id, None)
            if holder is not None:
                holder[1] = msgspec.structs.asdict(message)
                holder[0].set()
            return
        assert isinstance(message, BatchTextOut)
        now = time.perf_counter()
        states = self.states
        headers = message.headers or [None] * len(message.rids)
        logprobs = message.logprobs or [None] * len(message.rids)
        for rid, delta, token, finish, meta, header, logprob in zip(
            message.rids,
            message.text_deltas,
            message.token_ids,
            message.finished,
            message.meta,
            headers,
            logprobs,
        ):
            state = states.get(rid)
            if state is None:
                continue
            if header is not None:
                state.header = header
            if delta:
                state.text_parts.append(delta)
            if token >= 0:
                if not state.output_ids:
                    state.first_token_at = now
                state.output_ids.append(token)
                if logprob is not None:
                    state.output_logprobs.append(logprob.logprob)
                    state.output_top.append(logprob.top)
            if finish is not None:
                self._finish(state, finish, meta, now)
            if state.listener is not None and (delta or token >= 0 or finish is not None):
                with contextlib.suppress(Exception):  # nor may a listener
                    state.listener(state, delta, [token] if token >= 0 else [])

    def _finish(
        self, state: ReqState, finish: FinishReason, meta: RequestMeta | None, now: float
    ) -> None:
        state.finish_reason, state.meta, state.finished_at = finish, meta, now
        states = self.states
        with self.states_lock:
            states.pop(state.rid, None)
            members = self.groups.get(state.group) if state.group is not None else None
            if (
                members is not None
                and any(m is state for m in members)
                and not any(states.get(m.rid) is m for m in members)
            ):
                # its last copy ended (a copy's rid reused since is not one)
                self.groups.pop(state.group, None)
        if hooks.has("engine_request_done"):  # before the caller wakes: its spans end first
            _done_hook(state, None)
        state.done.set()
        if state.on_finish is not None:
            with contextlib.suppress(Exception):  # a progress callback must not stop the receiver
                state.on_finish(state)

    # ------------------------------------------------------------------ stages

    def tokenize(
        self, prompt=None, input_ids=None, messages=None
    ) -> tuple[list[list[int]], bool, list[PromptRequest]]:
        """The tokenize stage (engine/frontend/tokenize_stage.py) for this engine's tokenizer and model."""
        return tokenize_stage(self.tokenizer, self.model, prompt, input_ids, messages)

    def validate(self, ids: list[int], params: SamplingParams, index: int | None) -> SamplingParams:
        """Check one tokenized request against the model and pool; may shorten max_new_tokens to what
        the context and the pool leave (the server's default max_tokens relies on it). `index`: its
        place in a batch (named in errors), None for a single prompt."""
        where = f"request {index}: " if index is not None else ""
        if not ids:
            raise ValueError(f"{where}the prompt is empty (0 tokens)")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"{where}input_ids holds {t!r}, not a token id in [0, {self.vocab_size})"
                )
        if len(ids) >= self.context_length:
            raise ValueError(
                f"{where}the prompt has {len(ids)} tokens but context_length is {self.context_length} "
                "(a prompt must leave room for at least one new token)"
            )
        room = self.context_length - len(ids)
        # min_new_tokens with it: it may never exceed max_new_tokens
        if params.max_new_tokens > room:
            # more than the context leaves can only mean "as many as fit": what the KV pool holds too
            room = max(1, min(room, self.max_total_tokens + 1 - len(ids)))
            params = msgspec.structs.replace(
                params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room)
            )
        if len(ids) + params.max_new_tokens - 1 > self.max_total_tokens:
            raise ValueError(
                f"{where}the prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) needs more KV "
                f"than the whole pool holds (max_total_tokens={self.max_total_tokens})"
            )
        return params

    def submit(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        messages=None,
        rid=None,
        on_finish: Callable[[ReqState], None] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        listener=None,
        trace_context=None,
        beam: BeamParams | None = None,
        return_hidden_states=None,
        steering=None,
        layer_taps=None,
    ) -> tuple[list[ReqState], bool]:
        """Tokenize, validate everything, then send all requests in one message. Nothing is sent on error.

        A prompt with n > 1 becomes n requests (rids `<rid>-0` ... `<rid>-<n-1>`, seeds seed + i mod 2**63), which
        share the prompt's prefill through the prefix cache. Returns the states, prompt-major, and
        whether the caller passed a batch (or n > 1: a list comes back either way).
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        carrier = normalize_trace_context(trace_context)
        check_call_size(
            self.max_sequences_per_call, prompt, input_ids, messages, sampling_params, beam
        )
        id_lists, is_batch, items = self.tokenize(prompt, input_ids, messages)
        n_prompts = len(id_lists)
        if isinstance(sampling_params, list):
            if len(sampling_params) != n_prompts:
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {n_prompts} prompts"
                )
            params = []
            for i, p in enumerate(sampling_params):
                try:
                    params.append(self.parse_params(p))
                except ValueError as exc:  # which entry, in a list of hundreds
                    raise ValueError(f"sampling_params[{i}]: {exc}") from None
        else:
            params = [self.parse_params(sampling_params)] * n_prompts
        check_logprob_options(return_logprob, top_logprobs_num, logprob_start_len, self.vocab_size)
        params = [
            self.validate(ids, p, i if is_batch else None)
            for i, (ids, p) in enumerate(zip(id_lists, params))
        ]
        if beam is not None:
            for i, (ids, p) in enumerate(zip(id_lists, params)):
                problem = beam_problem(
                    len(ids), p, beam, self.max_running_requests, self.max_total_tokens
                )
                if problem is not None:
                    raise ValueError((f"request {i}: " if is_batch else "") + problem)
        layers = self.layer_request(
            return_hidden_states, steering, layer_taps, id_lists, params, beam, is_batch
        )
        for i, ids in enumerate(id_lists):
            if logprob_start_len >= len(ids):
                where = f"request {i}: " if is_batch else ""
                raise ValueError(
                    f"{where}logprob_start_len must be -1 or in [0, {len(ids)}) for a "
                    f"{len(ids)}-token prompt, got {logprob_start_len}"
                )
        base_rids = self._rids(rid, n_prompts, is_batch)
        reqs: list[TokenizedRequest] = []
        states: list[ReqState] = []
        items_of: list[PromptRequest] = []
        for base, ids, p, item in zip(base_rids, id_lists, params, items):
            copies = p.n
            for j in range(copies):
                r = base if copies == 1 else f"{base}-{j}"
                pj = (
                    p if copies == 1 else msgspec.structs.replace(p, n=1, seed=copy_seed(p.seed, j))
                )
                seq = next(self._seq)
                reqs.append(
                    TokenizedRequest(
                        r,
                        ids,
                        pj,
                        dict(carrier),
                        return_logprob,
                        top_logprobs_num,
                        logprob_start_len,
                        seq=seq,
                        beam=beam,
                        layers=layers,
                    )
                )
                items_of.append(item)
                states.append(
                    ReqState(
                        r,
                        ids,
                        seq,
                        len(states),
                        base if copies > 1 else None,
                        return_logprob,
                        logprob_start_len,
                        on_finish=on_finish,
                        listener=listener,
                        beam=beam,
                    )
                )
        check_unique_rids([s.rid for s in states])
        names = _names(states)
        # taken before the hooks see them, until registered (or the call fails)
        with self.states_lock:
            self._check_clash(names)
            self._reserved.update(names)
        announced: list[TokenizedRequest] = []
        registered = sent = False
        try:
            if hooks.has("engine_request_submitted"):
                for req, item in zip(reqs, items_of):
                    # first: a plugin called before the one that raises saw it
                    announced.append(req)
                    hooks.call(
                        "engine_request_submitted",
                        rid=req.rid,
                        request=item,
                        sampling=req.sampling,
                        trace_context=req.trace_context,
                        seq=req.seq,
                    )
            # registered and sent under one lock: an abort that finds the requests reaches the socket
            # after them (not before, matching nothing), and nothing stays registered unsent
            with self.send_lock:
                self._register(states)  # EngineDeadError if the engine died or shut down meanwhile
                registered = True
                now = time.time_ns()
                for req in reqs:
                    req.submitted_ns = now
                try:
                    payload = self.send_codec.encode(GenerateBatch(reqs))
                except (
                    UnicodeEncodeError,
                    OverflowError,
                    TypeError,
                ) as exc:  # a value no check above caught
                    raise ValueError(
                        f"the request cannot be sent to the scheduler: {exc}"
                    ) from None
                # the scheduler's socket would drop it, silently
                if len(payload) > MAX_MESSAGE_BYTES:
                    raise ValueError(
                        f"the call's {len(reqs)} requests encode to {len(payload):,} bytes, more than one "
                        f"message may carry ({MAX_MESSAGE_BYTES:,}): split it into several calls"
                    )
                self.send_sock.send(payload)
                sent = True
        # a hook, Ctrl-C while waiting for the socket or encoding, a value no check caught
        except BaseException as exc:
            if sent:
                raise
            if registered:
                self._unregister(states)
            else:
                with self.states_lock:
                    self._reserved.difference_update(names)
            _not_sent(announced, exc)
            raise
        return states, is_batch or any(p.n > 1 for p in params)

    def _unregister(self, states: list[ReqState]) -> None:
        """Forget requests registered but never sent (their callers get the error instead)."""
        with self.states_lock:
            for state in states:
                if self.states.get(state.rid) is state:
                    del self.states[state.rid]
                if state.group is not None and any(
                    m is state for m in self.groups.get(state.group, ())
                ):
                    self.groups.pop(state.group, None)

    def _register(self, states: list[ReqState]) -> None:
        with self.states_lock:
            # checked under the lock that _mark_dead takes: no state is orphaned
            if self.dead is not None:
                raise EngineDeadError(self.dead)  # (the caller then gives up the rids it reserved)
            self._reserved.difference_update(_names(states))
            for state in states:
                self.states[state.rid] = state
                if state.group is not None:
                    self.groups.setdefault(state.group, []).append(state)

    def _check_clash(self, names: list[str]) -> None:
        """A request's rid, or the rid of an n > 1 call (abort's name for its copies), must name
        nothing running: not a request, not another call's copies."""
        clash = [r for r in names if r in self.states or r in self.groups or r in self._reserved]
        if clash:
            raise ValueError(f"request id(s) already running: {clash}")

    def layer_request(
        self, return_hidden_states, steering, layer_taps, id_lists, params, beam, is_batch
    ) -> LayerRequest | None:
        """The call's hidden states, steering and plugin taps (engine/taps), checked for every prompt."""
        layers = layer_request(return_hidden_states, steering, layer_taps, self.taps)
        hidden = layers.hidden if layers is not None else None
        if hidden is None:
            return layers
        if beam is not None and hidden.tokens in ("generated", "all"):
            raise ValueError(
                "return_hidden_states.tokens must be 'last' or 'prompt' for beam search: its beams "
                "reorder at every step (a plugin tap sees each beam's rows)"
            )
        for i, (ids, p) in enumerate(zip(id_lists, params)):
            where = f"request {i}: " if is_batch else ""
            problem = size_problem(
                layers,
                len(ids),
                p.max_new_tokens,
                self.taps.hidden_size,
                self.max_hidden_state_bytes,
            )
            if problem is not None:
                raise ValueError(where + problem)
        return layers

    def parse_params(self, params) -> SamplingParams:
        return parse_sampling_params(params, self.vocab_size, get_logit_processor)

    def abort(self, rids: list[str], message: str = "aborted by the caller") -> None:
        """Ask the scheduler to stop these requests (a rid given for n > 1 stands for all its copies).
        The abort names each request's submission number: it cannot hit a later request reusing the rid."""
        if self.dead is not None:
            return
        with self.states_lock:
            named = [
                s
                for rid in rids
                for s in [*self.groups.get(rid, ()), self.states.get(rid)]
                if s is not None
            ]
        self.abort_requests(named, message)

    def _send_abort(self, live: list[ReqState], message: str) -> None:
        if live:
            message_out = AbortRequest([s.rid for s in live], message, [s.seq for s in live])
            with self.send_lock:
                # else the socket may be closed; the requests have failed already
                if self.dead is None:
                    self.send_sock.send(self.send_codec.encode(message_out))

    def abort_soon(self, states: list[ReqState], message: str = "aborted by the caller") -> None:
        """Abort these requests from where no lock may be taken (a finalizer run by the garbage collector,
        possibly in a thread that holds states_lock): queued here, sent by the receiver thread. Queued as
        the requests themselves, not their rids: a request given one of their rids meanwhile runs on."""
        if self.dead is None:
            self._deferred.append((list(states), message))
            self._wake()

    def _send_deferred(self) -> None:
        while self._deferred:
            self.abort_requests(*self._deferred.popleft())

    def abort_requests(
        self, states: list[ReqState], message: str = "aborted by the caller"
    ) -> None:
        """Abort these requests, those still running, and no later request given one of their rids."""
        if self.dead is not None:
            return
        with self.states_lock:  # each once (abort(["x", "x-0"]) names copy x-0 twice)
            live = list({id(s): s for s in states if self.states.get(s.rid) is s}.values())
        self._send_abort(live, message)

    @staticmethod
    def _rids(rid: Any, n: int, is_batch: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        rids = rid if isinstance(rid, list) else [rid]
        if len(rids) != n or not all(isinstance(r, str) and r for r in rids) or len(set(rids)) != n:
            raise ValueError(
                f"rid must be {'a list of ' + str(n) + ' distinct strings' if is_batch else 'a string'}"
            )
        return rids

    def wait(self, states: list[ReqState]) -> list[dict]:
        try:
            for state in states:
                state.done.wait()
        except BaseException:  # Ctrl-C in the caller: its requests must not run on
            self.abort_requests(states)
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

    def get_stats(self, timeout: float = 30.0) -> dict:
        stats = self._ask_scheduler(StatsRequest, timeout)
        with self.states_lock:  # this request's own holder is gone by now
            stats.setdefault("tracked", {})["user"] = {
                "states": len(self.states),
                "groups": len(self.groups),
                "pending_stats": len(self.pending_stats),
                "deferred_aborts": len(self._deferred),
            }
        if hooks.has("engine_stats"):
            stats["plugins"] = {
                **stats.get("plugins", {}),
                "user": hooks.call_named("engine_stats", role="user"),
            }
        return stats

    def flush_cache(self, timeout: float = 30.0) -> dict:
        return self._ask_scheduler(FlushCache, timeout)

    def _ask_scheduler(self, message_cls, timeout: float) -> dict:
        """Send a control message; the scheduler answers with Stats (through the detokenizer)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        req_id = uuid.uuid4().hex
        holder: list = [threading.Event(), None]
        with self.states_lock:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            self.pending_stats[req_id] = holder
        with self.send_lock:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            self.send_sock.send(self.send_codec.encode(message_cls(req_id)))
        if not holder[0].wait(timeout):
            with self.states_lock:
                self.pending_stats.pop(req_id, None)
            raise TimeoutError(f"the scheduler did not answer a {message_cls.__name__} message")
        if isinstance(holder[1], BaseException):
            raise holder[1]
        return holder[1]

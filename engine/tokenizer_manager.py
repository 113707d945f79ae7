"""TokenizerManager (user process): tokenize and validate, send to the scheduler, collect text results.

A receiver thread reads the detokenizer's outputs and the children's process sentinels in one zmq poll,
so a child's death is noticed at once and every waiting caller gets EngineDeadError.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import zmq

from engine.errors import EngineDeadError
from engine.ipc.channels import Endpoints, pull_socket, push_socket
from engine.ipc.messages import (
    BatchTextOut,
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
from engine.sampling_params import SamplingParams, parse_sampling_params


@dataclass
class ReqState:
    """What the user process knows about one request while it runs."""

    rid: str
    prompt_tokens: int
    created: float = field(default_factory=time.perf_counter)
    text_parts: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    meta: RequestMeta | None = None
    error: BaseException | None = None
    finished_at: float = 0.0
    first_token_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    on_finish: Callable[["ReqState"], None] | None = None

    def result(self) -> dict:
        if self.error is not None:
            raise self.error
        meta = self.meta or RequestMeta(self.prompt_tokens, len(self.output_ids))
        return {
            "text": "".join(self.text_parts),
            "output_ids": list(self.output_ids),
            "meta_info": {
                "id": self.rid,
                "prompt_tokens": meta.prompt_tokens,
                "completion_tokens": meta.completion_tokens,
                "cached_tokens": meta.cached_tokens,
                "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None,
                "e2e_latency": self.finished_at - self.created,
                "first_token_latency": (self.first_token_at or self.finished_at) - self.created,
            },
        }


class TokenizerManager:
    def __init__(self, tokenizer, endpoints: Endpoints) -> None:
        self.tokenizer = tokenizer
        self.zmq_ctx = zmq.Context(1)
        self.recv_sock = pull_socket(self.zmq_ctx, endpoints.tokenizer)
        self.send_sock = push_socket(self.zmq_ctx, endpoints.scheduler)
        self.wake_recv = self.zmq_ctx.socket(zmq.PAIR)
        self.wake_recv.bind(f"inproc://wake-{id(self)}")
        self.wake_send = self.zmq_ctx.socket(zmq.PAIR)
        self.wake_send.connect(f"inproc://wake-{id(self)}")
        self.send_codec = Codec(ToScheduler)
        self.recv_codec = Codec(ToTokenizer)
        self.send_lock = threading.Lock()
        self.states: dict[str, ReqState] = {}
        self.states_lock = threading.Lock()
        self.pending_stats: dict[str, list] = {}
        self.dead: str | None = None
        self.vocab_size = len(tokenizer)
        self.context_length = 0
        self.max_total_tokens = 0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self, sentinels: dict[int, str], info: dict, on_dead: Callable[[str], None]) -> None:
        """Begin receiving; `sentinels` maps each child's process sentinel fd to its role."""
        self.context_length = info["context_length"]
        self.max_total_tokens = info["max_total_tokens"]
        self.vocab_size = info["vocab_size"]  # the model's, which may exceed the tokenizer's
        self._on_dead = on_dead
        self._thread = threading.Thread(target=self._recv_loop, args=(sentinels,), name="engine-recv", daemon=True)
        self._thread.start()

    def close(self, reason: str = "the engine was shut down") -> None:
        self._mark_dead(reason)
        if self._thread is not None and self._thread.is_alive():
            self.wake_send.send(b"stop")
            self._thread.join(5)
        for sock in (self.recv_sock, self.send_sock, self.wake_recv, self.wake_send):
            sock.close(linger=0)
        self.zmq_ctx.term()

    def _mark_dead(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        with self.states_lock:
            states, self.states = list(self.states.values()), {}
            stats, self.pending_stats = list(self.pending_stats.values()), {}
        for state in states:
            state.error = EngineDeadError(self.dead)
            state.finished_at = time.perf_counter()
            state.done.set()
        for holder in stats:
            holder[1] = EngineDeadError(self.dead)
            holder[0].set()

    def _recv_loop(self, sentinels: dict[int, str]) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_sock, zmq.POLLIN)
        poller.register(self.wake_recv, zmq.POLLIN)
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self.wake_recv in events:
                return
            for fd, role in sentinels.items():
                if fd in events:
                    reason = f"the {role} process died; this engine can serve no more requests"
                    self._mark_dead(reason)
                    self._on_dead(reason)
                    return
            if self.recv_sock in events:
                try:
                    while True:
                        try:
                            data = self.recv_sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(self.recv_codec.decode(data))
                except Exception as exc:  # noqa: BLE001 - a dead receiver would leave every caller waiting
                    reason = f"the tokenizer manager's receiver failed ({type(exc).__name__}: {exc})"
                    self._mark_dead(reason)
                    self._on_dead(reason)
                    return

    def _dispatch(self, message) -> None:
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
        for rid, delta, token, finish, meta in zip(
            message.rids, message.text_deltas, message.token_ids, message.finished, message.meta
        ):
            state = states.get(rid)
            if state is None:
                continue
            if delta:
                state.text_parts.append(delta)
            if token >= 0:
                if not state.output_ids:
                    state.first_token_at = now
                state.output_ids.append(token)
            if finish is not None:
                state.finish_reason, state.meta, state.finished_at = finish, meta, now
                with self.states_lock:
                    states.pop(rid, None)
                state.done.set()
                if state.on_finish is not None:
                    with contextlib.suppress(Exception):  # a progress callback must not stop the receiver
                        state.on_finish(state)

    # ------------------------------------------------------------------ stages

    def tokenize(self, prompt=None, input_ids=None, messages=None) -> tuple[list[list[int]], bool]:
        """The tokenize stage. Returns the id lists and whether the caller passed a batch."""
        given = [name for name, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, input_ids or messages (got {given or 'none'})")
        if prompt is not None:
            if isinstance(prompt, str):
                return [self.tokenizer.encode(prompt)], False
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                return [self.tokenizer.encode(p) for p in prompt], True
            raise ValueError("prompt must be a string or a non-empty list of strings")
        if input_ids is not None:
            if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
                return [list(x) for x in input_ids], True
            if isinstance(input_ids, list):
                return [list(input_ids)], False
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            return [self._apply_chat_template(messages)], False
        if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
            return [self._apply_chat_template(m) for m in messages], True
        raise ValueError("messages must be a list of {'role', 'content'} dicts or a list of such lists")

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass prompt or input_ids instead")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def validate(self, ids: list[int], params: SamplingParams, index: int) -> SamplingParams:
        """Check one tokenized request against the model and pool; may shorten max_new_tokens to the context."""
        where = f"request {index}: " if index else ""
        if not ids:
            raise ValueError(f"{where}the prompt is empty (0 tokens)")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{where}input_ids holds {t!r}, not a token id in [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"{where}the prompt has {len(ids)} tokens but context_length is {self.context_length} "
                "(a prompt must leave room for at least one new token)"
            )
        room = self.context_length - len(ids)
        if params.max_new_tokens > room:
            params = msgspec.structs.replace(params, max_new_tokens=room)
        if len(ids) + params.max_new_tokens - 1 > self.max_total_tokens:
            raise ValueError(
                f"{where}the prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) needs more KV "
                f"than the whole pool holds (max_total_tokens={self.max_total_tokens})"
            )
        return params

    def submit(self, prompt=None, sampling_params=None, input_ids=None, messages=None, rid=None,
               on_finish: Callable[[ReqState], None] | None = None) -> tuple[list[ReqState], bool]:
        """Tokenize, validate everything, then send all requests in one message. Nothing is sent on error."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        id_lists, is_batch = self.tokenize(prompt, input_ids, messages)
        n = len(id_lists)
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts")
            params = [parse_sampling_params(p, self.vocab_size) for p in sampling_params]
        else:
            params = [parse_sampling_params(sampling_params, self.vocab_size)] * n
        params = [self.validate(ids, p, i if is_batch else 0) for i, (ids, p) in enumerate(zip(id_lists, params))]
        rids = self._rids(rid, n, is_batch)
        states = [ReqState(r, len(ids), on_finish=on_finish) for r, ids in zip(rids, id_lists)]
        message = GenerateBatch([TokenizedRequest(r, ids, p) for r, ids, p in zip(rids, id_lists, params)])
        with self.states_lock:
            if self.dead is not None:  # checked under the lock that _mark_dead takes: no state is orphaned
                raise EngineDeadError(self.dead)
            clash = [r for r in rids if r in self.states]
            if clash:
                raise ValueError(f"request id(s) already running: {clash}")
            for state in states:
                self.states[state.rid] = state
        with self.send_lock:
            self.send_sock.send(self.send_codec.encode(message))
        return states, is_batch

    @staticmethod
    def _rids(rid: Any, n: int, is_batch: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        rids = rid if isinstance(rid, list) else [rid]
        if len(rids) != n or not all(isinstance(r, str) and r for r in rids) or len(set(rids)) != n:
            raise ValueError(f"rid must be {'a list of ' + str(n) + ' distinct strings' if is_batch else 'a string'}")
        return rids

    def wait(self, states: list[ReqState]) -> list[dict]:
        for state in states:
            state.done.wait()
        return [s.result() for s in states]

    def get_stats(self, timeout: float = 30.0) -> dict:
        return self._ask_scheduler(StatsRequest, timeout)

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
            self.send_sock.send(self.send_codec.encode(message_cls(req_id)))
        if not holder[0].wait(timeout):
            with self.states_lock:
                self.pending_stats.pop(req_id, None)
            raise TimeoutError(f"the scheduler did not answer a {message_cls.__name__} message")
        if isinstance(holder[1], BaseException):
            raise holder[1]
        return holder[1]

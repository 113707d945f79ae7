"""A call to its requests (user process): every prompt and parameter checked against the model and the
pool, then one TokenizedRequest and ReqState per sequence, registered and sent to the scheduler in one
message. Nothing is sent when anything is wrong."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Any, Callable

import msgspec

from engine import hooks
from engine.beam_search.params import beam_problem
from engine.errors import EngineDeadError
from engine.frontend.layer_checks import LayerChecks
from engine.frontend.request_checks import (
    check_call_size,
    check_logprob_options,
    check_unique_rids,
)
from engine.frontend.request_state import ReqState
from engine.frontend.request_table import RequestTable, call_names
from engine.frontend.scheduler_channel import SchedulerChannel
from engine.hooks.types import PromptRequest
from engine.ipc.channels import MAX_MESSAGE_BYTES
from engine.ipc.messages import BeamParams, GenerateBatch, TokenizedRequest
from engine.sampling.processors import get_logit_processor
from engine.sampling_params import SamplingParams, copy_seed, parse_sampling_params
from engine.tracing.context import normalize_trace_context

logger = logging.getLogger(__name__)

_SEQ = itertools.count(1)

Tokenize = Callable[..., tuple[list[list[int]], bool, list[PromptRequest]]]


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


class Submission:
    def __init__(
        self,
        tokenize: Tokenize,
        table: RequestTable,
        channel: SchedulerChannel,
        layers: LayerChecks,
        vocab_size: int,
    ) -> None:
        self._tokenize = tokenize  # the tokenize stage (TokenizerManager.tokenize)
        self._table = table
        self._channel = channel
        self._layers = layers
        self._seq = _SEQ  # one count for every engine of the process: (rid, seq) names one request
        self.vocab_size = vocab_size
        self.context_length = 0
        self.max_total_tokens = 0
        self.max_running_requests = 0
        self.max_sequences_per_call = 0

    def configure(self, info: dict) -> None:
        """The model's and pool's bounds, from the scheduler's ready message."""
        self.context_length = info["context_length"]
        self.max_total_tokens = info["max_total_tokens"]
        self.max_running_requests = info["max_running_requests"]
        self.max_sequences_per_call = info["max_sequences_per_call"]
        self.vocab_size = info["vocab_size"]  # the model's, which may exceed the tokenizer's

    def parse_params(self, params) -> SamplingParams:
        return parse_sampling_params(params, self.vocab_size, get_logit_processor)

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
        if self._table.dead is not None:
            raise EngineDeadError(self._table.dead)
        carrier = normalize_trace_context(trace_context)
        check_call_size(
            self.max_sequences_per_call, prompt, input_ids, messages, sampling_params, beam
        )
        id_lists, is_batch, items = self._tokenize(prompt, input_ids, messages)
        n_prompts = len(id_lists)
        params = self._checked_params(
            sampling_params,
            id_lists,
            is_batch,
            beam,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
        )
        layers = self._layers.layer_request(
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
        self._send(reqs, states, items_of)
        return states, is_batch or any(p.n > 1 for p in params)

    def _checked_params(
        self,
        sampling_params,
        id_lists: list[list[int]],
        is_batch: bool,
        beam: BeamParams | None,
        return_logprob,
        top_logprobs_num,
        logprob_start_len,
    ) -> list[SamplingParams]:
        """Each prompt's sampling parameters, parsed and validated; the logprob options and a beam
        search's needs checked too."""
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
        return params

    def _send(
        self, reqs: list[TokenizedRequest], states: list[ReqState], items: list[PromptRequest]
    ) -> None:
        """Reserve the call's names, run the submit hooks, then register and send in one step; on any
        failure before the send, nothing stays registered or reserved."""
        names = call_names(states)
        # taken before the hooks see them, until registered (or the call fails)
        self._table.reserve(names)
        announced: list[TokenizedRequest] = []
        registered = sent = False
        try:
            if hooks.has("engine_request_submitted"):
                for req, item in zip(reqs, items):
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
            with self._channel.lock:
                # EngineDeadError if the engine died or shut down meanwhile
                self._table.register(states)
                registered = True
                now = time.time_ns()
                for req in reqs:
                    req.submitted_ns = now
                try:
                    payload = self._channel.encode(GenerateBatch(reqs))
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
                self._channel.send(payload)
                sent = True
        # a hook, Ctrl-C while waiting for the socket or encoding, a value no check caught
        except BaseException as exc:
            if sent:
                raise
            if registered:
                self._table.unregister(states)
            else:
                self._table.release(names)
            _not_sent(announced, exc)
            raise

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

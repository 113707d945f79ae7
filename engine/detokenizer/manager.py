"""DetokenizerManager: receive token outputs, decode them as a batch, match stop strings, send text
to the tokenizer manager; tell the scheduler to stop requests whose stop string matched."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import zmq

from engine import hooks
from engine.detokenizer.incremental import IncrementalDetokenizer
from engine.detokenizer.stop_meta import stopped_meta
from engine.detokenizer.stop_strings import StopMatcher
from engine.hooks import HookError
from engine.ipc.channels import pull_socket, push_socket
from engine.ipc.inbox import Inbox
from engine.ipc.messages import (
    STOP_STRING_MATCHED,
    AbortRequest,
    BatchTextOut,
    BatchTokenOut,
    BeamSearchOut,
    BeamTextOut,
    Codec,
    FinishReason,
    NO_TOKEN,
    ToDetokenizer,
    ToScheduler,
    ToTokenizer,
)
from engine.tokenizer import BatchDecoder

logger = logging.getLogger(__name__)


@dataclass
class StopState:
    matcher: StopMatcher
    min_new_tokens: int
    prompt_tokens: int
    cached_tokens: int
    tokens: int = 0
    seq: int = 0  # the request's submission number, for the abort that stops it
    hidden_states: bool = False  # its hidden states come with the scheduler's last output


def _check_texts(hook: str, texts, n: int, allow_none: bool = False) -> None:
    """What a hook returned or left must be one str per request, or the batch's callers would hang."""
    if texts is None and allow_none:
        return
    if (
        not isinstance(texts, (list, tuple))
        or len(texts) != n
        or not all(isinstance(t, str) for t in texts)
    ):
        plugins = ", ".join(hooks.implementers(hook))
        raise HookError(
            plugins, hook, TypeError(f"texts must be a list of {n} strings, got {texts!r:.200}")
        )


MAX_TOKEN_ID = 2**31 - 1


def malformed(message) -> str | None:
    """What makes a well-typed message one the scheduler could not have sent, or None: lists of
    unequal length, token ids no vocabulary has."""
    if isinstance(message, BatchTokenOut):
        n = len(message.rids)
        lengths = [len(message.token_ids), len(message.finished), len(message.meta)]
        lengths += [len(x) for x in (message.headers, message.logprobs) if x]
        if any(length != n for length in lengths):
            return f"tokens message with {n} rids but lists of {lengths}"
        if any(not -1 <= t <= MAX_TOKEN_ID for t in message.token_ids):
            return "tokens message with a token id out of range"
    elif isinstance(message, BeamSearchOut):
        if any(not 0 <= t <= MAX_TOKEN_ID for h in message.hypotheses for t in h.output_ids):
            return "beam search message with a token id out of range"
    return None


def _pick(out: BatchTokenOut, keep: list[int]) -> BatchTokenOut | None:
    """out with only the requests at the indices keep (None if none is left)."""
    if len(keep) == len(out.rids):
        return out
    if not keep:
        return None

    def pick(values: list) -> list:
        return [values[i] for i in keep] if values else values

    return BatchTokenOut(
        pick(out.rids),
        pick(out.token_ids),
        pick(out.finished),
        pick(out.meta),
        pick(out.headers),
        pick(out.logprobs),
    )


class DetokenizerManager:
    def __init__(self, model_dir: str, endpoints: dict) -> None:
        self.incremental = IncrementalDetokenizer(BatchDecoder(model_dir))
        self.zmq_ctx = zmq.Context(1)
        self.recv_sock = pull_socket(self.zmq_ctx, endpoints["detokenizer"])
        self.send_sock = push_socket(self.zmq_ctx, endpoints["tokenizer"])
        self.scheduler_sock = push_socket(self.zmq_ctx, endpoints["scheduler"])
        self.inbox = Inbox(self.recv_sock, Codec(ToDetokenizer), "engine::detokenizer", malformed)
        self.send_codec = Codec(ToTokenizer)
        self.scheduler_codec = Codec(ToScheduler)
        self.stop_states: dict[str, StopState] = {}  # requests with stop strings
        # finished here; the scheduler's remaining outputs are dropped
        self.stopped: set[str] = set()
        # stopped by a string, ending when the scheduler's last output brings their hidden states
        self.awaiting: dict[str, tuple[FinishReason, StopState]] = {}
        self.seqs: dict[str, int] = {}  # running request -> its submission number (aborts name it)
        self.info: dict = {}

    def serve_forever(self) -> None:
        while True:
            message = self.inbox.recv()
            if isinstance(message, BatchTokenOut):
                try:
                    message = self.detokenize(message)
                except Exception as exc:  # noqa: BLE001 - its requests fail with the reason; the others go on
                    logger.error(
                        "engine::detokenizer: a batch failed (%s: %s)", type(exc).__name__, exc
                    )
                    message = self._fail_batch(
                        message, f"the detokenizer failed ({type(exc).__name__}: {exc})"
                    )
                if message is None:
                    continue
                if hooks.has("engine_detokenize_output"):
                    try:
                        hooks.call("engine_detokenize_output", output=message)
                    except HookError as exc:  # read-only and after the fact: report, send as is
                        logger.error("engine::detokenizer: %s", exc)
            elif isinstance(message, BeamSearchOut):
                try:
                    message = self.detokenize_beams(message)
                except Exception as exc:  # noqa: BLE001 - the search fails with the reason; the process goes on
                    logger.error(
                        "engine::detokenizer: a beam search failed (%s: %s)",
                        type(exc).__name__,
                        exc,
                    )
                    message = self._failed_beams(
                        message, f"the detokenizer failed ({type(exc).__name__}: {exc})"
                    )
            else:  # Stats on its way to the user process: add this process's figures
                message.tracked["detokenizer"] = self.tracked()
                if hooks.has("engine_stats"):
                    try:
                        message.plugins["detokenizer"] = hooks.call_named(
                            "engine_stats", role="detokenizer"
                        )
                    except HookError as exc:
                        message.plugins["detokenizer"] = {"error": str(exc)}
            self.send_sock.send(self.send_codec.encode(message))

    def tracked(self) -> dict[str, int]:
        """This process's per-request structures and their sizes: all 0 when nothing runs."""
        return {
            "decode_states": len(self.incremental.states),
            "stop_states": len(self.stop_states),
            "stopped": len(self.stopped),
            "awaiting_meta": len(self.awaiting),
            "seqs": len(self.seqs),
        }

    @staticmethod
    def _failed_beams(out: BeamSearchOut, message: str) -> BeamTextOut:
        """The search's answer when its text cannot be made: its best hypothesis ends in an abort naming why."""
        reason = FinishReason("abort", message=message)
        hypotheses = [msgspec.structs.replace(h, finish=reason) for h in out.hypotheses[:1]]
        return BeamTextOut(
            out.rid, hypotheses, [""] * len(hypotheses), out.meta, out.width, out.steps, 0.0
        )

    def detokenize_beams(self, out: BeamSearchOut) -> BeamTextOut:
        """A finished beam search: one batch decode of its returned hypotheses, and nothing else (no
        per-step text for beams nobody reads)."""
        start = time.perf_counter()
        texts = self.incremental.decoder.decode_batch(
            [h.output_ids for h in out.hypotheses],
            out.skip_special_tokens,
            out.spaces_between_special_tokens,
        )
        return BeamTextOut(
            out.rid,
            out.hypotheses,
            texts,
            out.meta,
            out.width,
            out.steps,
            time.perf_counter() - start,
        )

    def detokenize(self, out: BatchTokenOut) -> BatchTextOut | None:
        """The detokenize stage: one batch decode for every request in the message, then stop strings."""
        if self.stopped:
            out = self._drop_stopped(out)
            if out is None:
                return None
        for rid, header in zip(out.rids, out.headers):
            if header is not None:
                self.incremental.start(
                    rid, header.skip_special_tokens, header.spaces_between_special_tokens
                )
                if header.seq:
                    self.seqs[rid] = header.seq
                if header.stop:
                    self.stop_states[rid] = StopState(
                        StopMatcher(header.stop),
                        header.min_new_tokens,
                        header.prompt_tokens,
                        header.cached_tokens,
                        seq=header.seq,
                        hidden_states=header.hidden_states,
                    )
        out = self._drop_strays(out)
        if out is None:
            return None
        if self.awaiting:
            self._end_awaiting(out)
        finished = [f is not None for f in out.finished]
        try:
            deltas = self._decode(out, finished)
        except HookError as exc:  # a plugin failed on this batch: its requests fail, the rest go on
            return self._fail_batch(out, str(exc))
        if self.stop_states:
            self._match_stop_strings(out, deltas)
        if self.seqs:
            for rid, f in zip(out.rids, out.finished):
                if f is not None:
                    self.seqs.pop(rid, None)
        return BatchTextOut(
            out.rids, deltas, out.token_ids, out.finished, out.meta, out.headers, out.logprobs
        )

    def _decode(self, out: BatchTokenOut, finished: list[bool]) -> list[str]:
        deltas = None
        if hooks.has("engine_detokenize"):
            deltas = hooks.call_first(
                "engine_detokenize", rids=out.rids, token_ids=out.token_ids, finished=finished
            )
            _check_texts("engine_detokenize", deltas, len(out.rids), allow_none=True)
        if deltas is None:
            deltas = self.incremental.step(
                out.rids, [[t] if t >= 0 else [] for t in out.token_ids], finished
            )
        else:
            deltas = list(deltas)
            for rid, done in zip(out.rids, finished):
                if done:
                    self.incremental.forget(rid)
        if hooks.has("engine_detokenize_after"):
            hooks.call("engine_detokenize_after", rids=out.rids, texts=deltas)
            _check_texts("engine_detokenize_after", deltas, len(out.rids))
        return deltas

    def _fail_batch(self, out: BatchTokenOut, message: str) -> BatchTextOut:
        reason = FinishReason("abort", message=message)
        running = [rid for rid, f in zip(out.rids, out.finished) if f is None]
        seqs = [self.seqs.get(rid, 0) for rid in running]
        held = []  # text a stop string held back: it reaches the caller when a request ends without a match
        for rid in out.rids:
            self.incremental.forget(rid)
            state = self.stop_states.pop(rid, None)
            self.awaiting.pop(rid, None)
            held.append(state.matcher.pending if state is not None else "")
            self.seqs.pop(rid, None)
        if running:
            self.stopped.update(running)
            self.scheduler_sock.send(
                self.scheduler_codec.encode(AbortRequest(running, message, seqs))
            )
        n = len(out.rids)
        return BatchTextOut(
            out.rids, held, out.token_ids, [reason] * n, out.meta, out.headers, out.logprobs
        )

    def _match_stop_strings(self, out: BatchTokenOut, deltas: list[str]) -> None:
        stopping: list[str] = []
        seqs: list[int] = []
        for i, rid in enumerate(out.rids):
            state = self.stop_states.get(rid)
            if state is None:
                continue
            if out.token_ids[i] >= 0:
                state.tokens += 1
            final = out.finished[i] is not None
            # too early to stop (a final output flushes what is held)
            if state.tokens < state.min_new_tokens:
                deltas[i] = state.matcher.release(deltas[i], final)
                matched = None
            else:
                deltas[i], matched = state.matcher.feed(deltas[i], final)
            if matched is not None:
                reason = FinishReason("stop", matched=matched)
                # the scheduler has not finished it yet: stop it, drop what it still sends
                if not final:
                    stopping.append(rid)
                    seqs.append(state.seq)
                    self.stopped.add(rid)
                    self.incremental.forget(rid)
                if state.hidden_states and not final:  # its last output brings them
                    self.awaiting[rid] = (reason, state)
                else:
                    out.finished[i] = reason
                    out.meta[i] = stopped_meta(
                        out.meta[i], state.prompt_tokens, state.cached_tokens, state.tokens
                    )
                final = True
            if final:
                del self.stop_states[rid]
        if stopping:
            self.scheduler_sock.send(
                self.scheduler_codec.encode(AbortRequest(stopping, STOP_STRING_MATCHED, seqs))
            )

    def _end_awaiting(self, out: BatchTokenOut) -> None:
        """The scheduler's last output of a request a stop string ended: no token, the stop as its
        reason (unless the scheduler failed it: that error stays), and the counters and hidden
        states up to the match."""
        for i, rid in enumerate(out.rids):
            if out.finished[i] is not None and rid in self.awaiting:
                reason, state = self.awaiting.pop(rid)
                out.token_ids[i] = NO_TOKEN
                ended = out.finished[i]
                if ended.type != "abort" or ended.message == STOP_STRING_MATCHED:
                    out.finished[i] = reason
                out.meta[i] = stopped_meta(
                    out.meta[i], state.prompt_tokens, state.cached_tokens, state.tokens
                )

    def _drop_stopped(self, out: BatchTokenOut) -> BatchTokenOut | None:
        """Remove outputs of requests already finished by a stop string; their last one clears them
        (and is kept when it brings the hidden states of one)."""
        keep = []
        for i, rid in enumerate(out.rids):
            if rid in self.stopped:
                if out.finished[i] is not None:
                    self.stopped.discard(rid)
                    if rid in self.awaiting:
                        keep.append(i)
            else:
                keep.append(i)
        return _pick(out, keep)

    def _drop_strays(self, out: BatchTokenOut) -> BatchTokenOut | None:
        """Remove running outputs of requests that never started here (no header came first): the
        scheduler sends none, and each would leave a decode state no finish ever clears."""
        known = self.incremental.states
        keep = [
            i
            for i, (rid, f) in enumerate(zip(out.rids, out.finished))
            if f is not None or rid in known
        ]
        if len(keep) < len(out.rids):
            dropped = len(out.rids) - len(keep)
            logger.warning(
                "engine::detokenizer: dropped outputs of %d request(s) it never started", dropped
            )
        return _pick(out, keep)

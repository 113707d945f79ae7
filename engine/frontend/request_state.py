"""What the user process knows about one request while it runs, and how it becomes a result dict."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.ipc.messages import BeamParams, BeamTextOut, FinishReason, RequestHeader, RequestMeta
from engine.taps.result import hidden_states_dict


def lp_tuples(logprobs: list, token_ids: list[int]) -> list[tuple]:
    return [(lp, t, None) for lp, t in zip(logprobs, token_ids)]


def top_tuples(top) -> list[tuple] | None:
    return None if top is None else [(lp, t, None) for t, lp in zip(top.token_ids, top.logprobs)]


def beam_hypotheses(out: BeamTextOut | None) -> list[dict]:
    """A beam search's result: the returned hypotheses, best first (none when it was aborted)."""
    if out is None:
        return []
    return [
        {
            "text": text,
            "output_ids": list(h.output_ids),
            "logprob": h.logprob,
            "score": h.score,
            "finish_reason": h.finish.to_dict(),
        }
        for h, text in zip(out.hypotheses, out.texts)
    ]


@dataclass
class ReqState:
    """What the user process knows about one request while it runs."""

    rid: str
    prompt_ids: list[int]
    # this submission's number: aborts name it, so a reused rid is never hit by an old abort
    seq: int = 0
    index: int = 0  # position in the caller's result list
    group: str | None = None  # the rid the caller gave, for the copies of an n > 1 request
    return_logprob: bool = False
    logprob_start_len: int = -1
    created: float = field(default_factory=time.perf_counter)
    text_parts: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    meta: RequestMeta | None = None
    header: RequestHeader | None = None
    output_logprobs: list = field(default_factory=list)
    output_top: list = field(default_factory=list)
    error: BaseException | None = None
    finished_at: float = 0.0
    first_token_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    on_finish: Callable[["ReqState"], None] | None = None
    # called in the receiver thread with (state, text delta, new token ids) after each output, and with
    # (state, None, None) if the engine dies; streaming and async callers listen here
    listener: Callable[["ReqState", str | None, list[int] | None], None] | None = None
    beam: BeamParams | None = None  # a beam search: its result is `hypotheses`, not text
    beam_out: BeamTextOut | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def meta_info(self) -> dict:
        meta = self.meta
        header = self.header
        cached = meta.cached_tokens if meta else (header.cached_tokens if header else 0)
        info = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": meta.completion_tokens if meta else len(self.output_ids),
            "cached_tokens": cached,
            "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None,
            "e2e_latency": (self.finished_at or time.perf_counter()) - self.created,
            "first_token_latency": (self.first_token_at or self.finished_at or time.perf_counter())
            - self.created,
        }
        if meta is not None and meta.hidden_states is not None:
            info["hidden_states"] = hidden_states_dict(meta.hidden_states)
        if self.beam is not None:
            out = self.beam_out
            info["beam_width"] = self.beam.width
            info["steps"] = out.steps if out else 0
            info["detokenize_seconds"] = out.detokenize_seconds if out else 0.0
        if self.return_logprob:
            info["output_token_logprobs"] = lp_tuples(self.output_logprobs, self.output_ids)
            if any(t is not None for t in self.output_top):
                info["output_top_logprobs"] = [top_tuples(t) for t in self.output_top]
            if self.logprob_start_len >= 0:
                ids = self.prompt_ids[self.logprob_start_len :]
                info["input_token_logprobs"] = (
                    lp_tuples(header.input_logprobs, ids) if header else []
                )
                if header and any(t is not None for t in header.input_top):
                    info["input_top_logprobs"] = [top_tuples(t) for t in header.input_top]
        return info

    def result(self) -> dict:
        if self.error is not None:
            raise self.error
        if self.beam is not None:
            return {"hypotheses": beam_hypotheses(self.beam_out), "meta_info": self.meta_info()}
        return {
            "text": "".join(self.text_parts),
            "output_ids": list(self.output_ids),
            "meta_info": self.meta_info(),
        }

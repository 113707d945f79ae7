"""Checks on a request as it reaches the scheduler, before any value in it indexes a tensor.

Why again: the user process validates everything, but the scheduler's socket takes any well-typed
message, and one bad value (a logit_bias key of 10**6, a token id past the vocabulary) would raise
inside a step and fail every request batched with it. Each check here names the field it refuses;
the request then fails alone, before it is queued.
"""

from __future__ import annotations

import msgspec

from engine.ipc.messages import TokenizedRequest
from engine.sampling.processors import get_logit_processor
from engine.sampling_params import parse_sampling_params

MAX_TOP_LOGPROBS = 100  # as the user process allows


def _ids_out_of_range(ids, vocab_size: int) -> object | None:
    for t in ids:
        if not 0 <= t < vocab_size:
            return t
    return None


def check_request(req: TokenizedRequest, vocab_size: int, context_len: int) -> str | None:
    """Why this request cannot be queued (a message naming the field), or None when it can."""
    if not req.rid:
        return "rid must be a non-empty string"
    n = len(req.input_ids)
    if n == 0:
        return "input_ids is empty (0 tokens)"
    bad = _ids_out_of_range(req.input_ids, vocab_size)
    if bad is not None:
        return f"input_ids holds {bad!r}, not a token id in [0, {vocab_size})"
    if n >= context_len:
        return f"input_ids has {n} tokens but context_length is {context_len}"
    try:  # the user process's own parser: every sampling field, its range, and the same messages; not a
        # grammar's parse (the user process did it; a compile that fails fails the request alone, off the loop)
        params = msgspec.structs.asdict(req.sampling)
        params["logit_bias"] = dict(params["logit_bias"])
        parse_sampling_params(params, vocab_size, get_logit_processor, parse_grammar=False)
    except (ValueError, TypeError) as exc:
        return f"sampling: {exc}"
    if not 0 <= req.top_logprobs_num <= min(MAX_TOP_LOGPROBS, vocab_size):
        return f"top_logprobs_num must be in [0, {min(MAX_TOP_LOGPROBS, vocab_size)}], got {req.top_logprobs_num}"
    if not (req.logprob_start_len == -1 or 0 <= req.logprob_start_len < n):
        return f"logprob_start_len must be -1 or in [0, {n}), got {req.logprob_start_len}"
    if req.submitted_ns < 0:
        return f"submitted_ns must be >= 0, got {req.submitted_ns}"
    return None


def clip_to_context(req: TokenizedRequest, context_len: int) -> TokenizedRequest:
    """Shorten max_new_tokens (and min_new_tokens with it) to what the context leaves after the prompt."""
    room = context_len - len(req.input_ids)
    p = req.sampling
    if p.max_new_tokens <= room:
        return req
    sampling = msgspec.structs.replace(
        p, max_new_tokens=room, min_new_tokens=min(p.min_new_tokens, room)
    )
    return msgspec.structs.replace(req, sampling=sampling)

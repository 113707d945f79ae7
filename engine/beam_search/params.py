"""What a beam search may be asked for, checked in the user process (ValueError) and again where it
reaches the scheduler (the request is refused alone). No torch here: the user process imports it.

Beams are the K best continuations by cumulative log-probability, so everything that draws at random
or cuts the distribution is refused by name (temperature > 0, top_p, top_k, min_p, seed, n), as are
stop strings (they are matched on text, after selection) and streaming or per-token logprobs.
"""

from __future__ import annotations

import math
from typing import Any

from engine.ipc.messages import BeamParams
from engine.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 512
EARLY_STOPPING = (False, True, "never")
# sampling parameters that make sense for beams
BEAM_SAMPLING_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "logit_bias",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "custom_logit_processor",
    "custom_params",
    "temperature",
    "json_schema",
    "regex",
    "ebnf",
)
REFUSED = {
    "temperature": "beam search is deterministic (only temperature=0 is accepted)",
    "top_p": "beams keep the K best continuations of the whole distribution",
    "top_k": "beams keep the K best continuations of the whole distribution",
    "min_p": "beams keep the K best continuations of the whole distribution",
    "seed": "beam search draws nothing at random",
    "n": "use num_return_sequences",
    "stop": "stop strings are matched on text after selection; use stop_token_ids",
    "stream": "a beam search's hypotheses are known only at its end",
    "return_logprob": "each hypothesis comes with its cumulative logprob and score",
    "top_logprobs_num": "not for beam search",
    "logprob_start_len": "not for beam search",
}


def _refused(name: str, value: Any) -> bool:
    if name == "temperature":
        return value != 0
    return True


def split_beam_kwargs(kwargs: dict) -> dict:
    """The sampling dict for a beam search's keyword arguments; ValueError naming every refused or
    unknown one."""
    refused = [k for k, v in kwargs.items() if k in REFUSED and _refused(k, v)]
    if refused:
        reasons = "; ".join(f"{k}: {REFUSED[k]}" for k in refused)
        raise ValueError(f"beam search does not take {refused} ({reasons})")
    unknown = sorted(set(kwargs) - set(BEAM_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown beam search argument(s) {unknown}; sampling parameters taken: {sorted(BEAM_SAMPLING_FIELDS)}"
        )
    params = dict(kwargs)
    params["temperature"] = 0.0
    return params


def beam_params(
    beam_width: Any, num_return_sequences: Any, length_penalty: Any, early_stopping: Any
) -> BeamParams:
    """BeamParams from Engine.beam_search's arguments; ValueError naming the one at fault."""
    params = BeamParams(beam_width, num_return_sequences, length_penalty, early_stopping)
    problem = check_beam(params, None, MAX_BEAM_WIDTH)
    if problem is not None:
        raise ValueError(problem)
    return params


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_beam(beam: BeamParams, sampling: SamplingParams | None, max_width: int) -> str | None:
    """Why this beam search cannot run (naming the field), or None. `max_width`: beams need a request
    slot each."""
    k = beam.width
    if not _int(k) or not 1 <= k <= min(max_width, MAX_BEAM_WIDTH):
        return f"beam_width must be an integer in [1, {min(max_width, MAX_BEAM_WIDTH)}], got {k!r}"
    if not _int(beam.num_return) or not 1 <= beam.num_return <= k:
        return f"num_return_sequences must be an integer in [1, beam_width={k}], got {beam.num_return!r}"
    lp = beam.length_penalty
    if (
        isinstance(lp, bool)
        or not isinstance(lp, (int, float))
        or not math.isfinite(lp)
        or abs(lp) > 100
    ):
        return f"length_penalty must be a finite number in [-100, 100], got {lp!r}"
    if not any(
        beam.early_stopping is e or (isinstance(e, str) and beam.early_stopping == e)
        for e in EARLY_STOPPING
    ):
        return f"early_stopping must be False, True or 'never', got {beam.early_stopping!r}"
    if sampling is not None:
        if (
            not sampling.is_greedy
            or sampling.top_p < 1
            or sampling.min_p > 0
            or sampling.seed is not None
        ):
            return "sampling: a beam search takes no temperature, top_p, top_k, min_p or seed"
        if sampling.n != 1:
            return f"sampling: n must be 1 for a beam search (use num_return_sequences), got {sampling.n}"
        if sampling.stop:
            return "sampling: a beam search takes no stop strings (use stop_token_ids)"
    return None


def beam_problem(
    prompt_len: int,
    sampling: SamplingParams,
    beam: BeamParams,
    max_width: int,
    max_total_tokens: int,
) -> str | None:
    """Why this beam search can never run on this engine (its checks, then its whole KV need against the
    pool), or None. The user process raises it; the scheduler refuses the request with it."""
    problem = check_beam(beam, sampling, max_width)
    if problem is not None:
        return problem
    need = kv_tokens_needed(prompt_len, beam, sampling.max_new_tokens)
    if need > max_total_tokens:
        return (
            f"the beam search needs up to {need} KV tokens (prompt {prompt_len} + beam_width {beam.width} x "
            f"{sampling.max_new_tokens - 1} decode steps) but the pool holds max_total_tokens={max_total_tokens}"
        )
    return None


def kv_tokens_needed(prompt_len: int, beam: BeamParams, max_new_tokens: int) -> int:
    """The most pool tokens a beam search holds: its prompt plus one token per beam per decode step
    (the last token of a hypothesis is chosen, never computed)."""
    return prompt_len + beam.width * max(max_new_tokens - 1, 0)

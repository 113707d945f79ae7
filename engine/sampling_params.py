"""Sampling parameters: parsed and validated in the user process, before anything is queued."""

from __future__ import annotations

import math
from typing import Any

import msgspec

DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_TEMPERATURE = 1e-5  # below this a temperature is treated as 0: dividing logits by it would overflow


class SamplingParams(msgspec.Struct, array_like=True, frozen=True):
    """What the scheduler needs to sample one request. Travels inside the request message."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


FIELDS = {name for name in SamplingParams.__struct_fields__}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_sampling_params(params: dict | SamplingParams | None, vocab_size: int) -> SamplingParams:
    """Turn a user's dict into SamplingParams; raise ValueError naming the field and its allowed range."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        params = msgspec.structs.asdict(params)
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
    unknown = sorted(set(params) - FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; supported: {sorted(FIELDS)}")
    p = dict(params)

    max_new = p.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not _is_int(max_new) or max_new < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
    temperature = p.get("temperature", 1.0)
    if not _is_number(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    top_p = p.get("top_p", 1.0)
    if not _is_number(top_p) or not (0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    top_k = p.get("top_k", -1)
    if not _is_int(top_k) or (top_k < 1 and top_k not in (-1, 0)):
        raise ValueError(f"top_k must be -1 or 0 (no limit) or an integer >= 1, got {top_k!r}")
    stop_ids = p.get("stop_token_ids") or ()
    if isinstance(stop_ids, int) and not isinstance(stop_ids, bool):
        stop_ids = (stop_ids,)
    if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) and 0 <= t < vocab_size for t in stop_ids):
        raise ValueError(f"stop_token_ids must be a list of token ids in [0, {vocab_size}), got {stop_ids!r}")
    ignore_eos = p.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r}")
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=-1 if top_k == 0 else top_k,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
    )

"""Sampling parameters: parsed and validated in the user process, before anything is queued.

docs/sampling.md lists every parameter with its range and meaning. Each check raises a ValueError
that names the field and its allowed range.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import msgspec

DEFAULT_MAX_NEW_TOKENS = 128
# below this a temperature is treated as 0: dividing logits by it would overflow
GREEDY_TEMPERATURE = 1e-5
MAX_N = 128
MAX_STOP_STRINGS = 16
# Each stop token id widens a beam search's selection (1 + stop ids candidates per beam) and adds an entry to
# the running batch's stop check every decode step; a model has a handful of ending tokens, not thousands.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 100.0
# Bounds that keep every value finite in the scheduler's float32 tensors: a temperature past float32's
# range became inf (logits / inf -> NaN -> token 0), a repetition penalty near 0 sent logits / penalty to inf.
# Past MAX_TEMPERATURE sampling is practically uniform anyway; 1 / MIN_REPETITION_PENALTY keeps a logit finite.
MAX_TEMPERATURE = 1e6
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
SEED_RANGE = 2**63  # seeds are in [0, SEED_RANGE)


class SamplingParams(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """What the scheduler and the detokenizer need to sample and decode one request."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    custom_logit_processor: str | None = None  # a registered name (engine/sampling/processors.py)
    custom_params: dict[str, Any] | None = None  # JSON for the custom processor
    # structured output (docs/structured_output.md): at most one, each as text (a schema as JSON)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


FIELDS = {name for name in SamplingParams.__struct_fields__}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(p: dict, name: str, default: float, ok: Callable[[float], bool], allowed: str) -> float:
    value = p.get(name, default)
    if not _is_number(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _flag(p: dict, name: str, default: bool) -> bool:
    value = p.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _stop_token_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    """At most MAX_STOP_TOKEN_IDS ids as given (so a long list is refused before it is walked), each once,
    in their first order."""
    if value is None:
        return ()
    if _is_int(value):
        value = (value,)
    if isinstance(value, (list, tuple)) and len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}"
        )
    if not isinstance(value, (list, tuple)) or not all(
        _is_int(t) and 0 <= t < vocab_size for t in value
    ):
        raise ValueError(
            f"stop_token_ids must be a list of token ids in [0, {vocab_size}), got {value!r}"
        )
    return tuple(dict.fromkeys(value))


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if (
        not isinstance(value, (list, tuple))
        or not all(isinstance(s, str) and s for s in value)
        or len(value) > MAX_STOP_STRINGS
    ):
        raise ValueError(
            f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, got {value!r}"
        )
    for i, s in enumerate(value):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no output text can ever hold it
            raise ValueError(
                f"stop[{i}] is not valid Unicode text: a lone surrogate {s[exc.start]!r} at character {exc.start}"
            ) from None
    return tuple(value)


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError(
            f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        # not "+5", " 5", "٥"
        token = int(key) if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key) else key
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}")
        if not _is_number(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"
            )
        if token in out:  # "05" and "5": which bias applied would depend on the order of the keys
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _constraint(p: dict, parse: bool) -> dict[str, str]:
    """json_schema, regex or ebnf: at most one, and (with `parse`) it must parse (the grammar engine
    is imported only here, only when one is given)."""
    from engine.grammar.constraints import check, normalize

    constraint = normalize(p)
    for kind, text in constraint.items():
        if p.get("ignore_eos"):
            raise ValueError(
                f"ignore_eos cannot be used with {kind}: the grammar ends the output with EOS"
            )
        if parse:
            check(kind, text)
    return constraint


def copy_seed(seed: int | None, j: int) -> int | None:
    """The seed of copy j of an n > 1 request: seed + j, wrapped so it stays in [0, 2**63)."""
    return None if seed is None else (seed + j) % SEED_RANGE


def _has_non_finite(value: Any) -> bool:
    """A NaN or infinity anywhere in a JSON-like value (iterative: no depth limit of its own)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return False


def parse_sampling_params(
    params: dict | SamplingParams | None,
    vocab_size: int,
    processors: Callable[[str], Any] | None = None,
    parse_grammar: bool = True,
) -> SamplingParams:
    """Turn a user's dict into SamplingParams; raise ValueError naming the field and its allowed range.

    `processors(name)` returns the registered custom logit processor class or raises ValueError.
    `parse_grammar=False` (the scheduler's arrival checks) skips parsing a constraint: the user process
    did, a compile that fails fails its request alone, and the step loop must not wait on a parse.
    """
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        params = msgspec.structs.asdict(params)
        params["logit_bias"] = dict(params["logit_bias"])
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
    odd = [key for key in params if not isinstance(key, str)]
    if odd:
        raise ValueError(f"sampling parameter names must be strings, got {odd[0]!r}")
    unknown = sorted(set(params) - FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; supported: {sorted(FIELDS)}")
    p = dict(params)

    max_new = p.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not _is_int(max_new) or max_new < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
    min_new = p.get("min_new_tokens", 0)
    if not _is_int(min_new) or not 0 <= min_new <= max_new:
        raise ValueError(
            f"min_new_tokens must be an integer in [0, max_new_tokens={max_new}], got {min_new!r}"
        )
    temperature = _number(
        p,
        "temperature",
        1.0,
        lambda v: 0 <= v <= MAX_TEMPERATURE,
        f"a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)",
    )
    top_p = _number(p, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = p.get("top_k", -1)
    if not _is_int(top_k) or (top_k < 1 and top_k not in (-1, 0)):
        raise ValueError(f"top_k must be -1 or 0 (no limit) or an integer >= 1, got {top_k!r}")
    # the whole vocabulary: any size is usable (2**63 overflowed an int64 tensor)
    if top_k >= vocab_size:
        top_k = -1
    min_p = _number(p, "min_p", 0.0, lambda v: 0 <= v <= 1, "in [0, 1]")
    repetition = _number(
        p,
        "repetition_penalty",
        1.0,
        lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
        f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 means off)",
    )
    frequency = _number(
        p, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2] (0 means off)"
    )
    presence = _number(
        p, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2] (0 means off)"
    )
    seed = p.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_RANGE):
        raise ValueError(f"seed must be None or an integer in [0, 2**63), got {seed!r}")
    n = p.get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    name = p.get("custom_logit_processor")
    custom_params = p.get("custom_params")
    if custom_params is not None:
        if not isinstance(custom_params, dict):
            raise ValueError(
                f"custom_params must be a JSON object (dict), got {type(custom_params).__name__}"
            )
        try:
            custom_params = msgspec.json.decode(msgspec.json.encode(custom_params))
        except (
            TypeError,
            msgspec.EncodeError,
            RecursionError,
        ) as exc:  # RecursionError: nested too deep
            raise ValueError(f"custom_params must be JSON-serializable: {exc}") from None
        # JSON has no NaN or infinity: they came through as null
        if _has_non_finite(p["custom_params"]):
            raise ValueError(
                "custom_params must hold finite numbers only (JSON has no NaN or infinity)"
            )
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"custom_logit_processor must be a registered name (a string), got {name!r}"
            )
        if processors is None:
            raise ValueError(f"custom_logit_processor {name!r}: no processors are registered")
        processors(name)().validate_params(custom_params or {}, vocab_size)
    elif custom_params is not None:
        raise ValueError("custom_params is set but custom_logit_processor is not")
    constraint = _constraint(p, parse_grammar)
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=min_p,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
        stop=_stop_strings(p.get("stop")),
        stop_token_ids=_stop_token_ids(p.get("stop_token_ids"), vocab_size),
        ignore_eos=_flag(p, "ignore_eos", False),
        seed=seed,
        n=n,
        skip_special_tokens=_flag(p, "skip_special_tokens", True),
        spaces_between_special_tokens=_flag(p, "spaces_between_special_tokens", True),
        logit_bias=_logit_bias(p.get("logit_bias"), vocab_size),
        custom_logit_processor=name,
        custom_params=custom_params,
        **constraint,
    )

"""OpenAI requests -> the engine's generate arguments, and the engine's results -> OpenAI responses.

Mostly renaming: every value is checked by the engine itself (a ValueError naming the field becomes
a 400 in the client's words), so the served and the offline engine accept and refuse the same
things. Checked here is only what the engine has no name for: max_tokens past the context, seed's
int64 range, best_of, suffix, two structured-output constraints in different names (OpenAI's, SGLang's,
vLLM's). Logprobs: engine/serve/logprobs.py.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

# the engine's seeds: [0, SEED_RANGE); OpenAI's any int64, taken modulo it
from engine.sampling_params import (
    SEED_RANGE,
)
from engine.serve.errors import OpenAIError
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, TextPart

COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's API documents it

# OpenAI name -> engine name, for the fields that are only renamed
_RENAMED = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
_PASSED = (
    "temperature",
    "top_p",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "custom_logit_processor",
    "custom_params",
)
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit
_ENGINE_NAMES = {
    **{v: k for k, v in _RENAMED.items()},
    "json_schema": "response_format",
    "input_ids": "prompt",
}
# structured output: (the client's field, the engine's kind) of each way to ask for it; OpenAI's
# response_format, SGLang's json_schema, regex and ebnf, vLLM's guided_* and structured_outputs
_CONSTRAINTS = (
    ("response_format", "json_schema"),
    ("json_schema", "json_schema"),
    ("regex", "regex"),
    ("ebnf", "ebnf"),
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "regex"),
    ("guided_grammar", "ebnf"),
)
_STRUCTURED_OUTPUTS = (
    ("json_", "json", "json_schema"),
    ("regex", "regex", "regex"),
    ("choice", "choice", "regex"),
    ("grammar", "grammar", "ebnf"),
    ("json_object", "json_object", "json_schema"),
)
# the per-request layer fields; an engine error names the entry and key (steering[0].vector)
_LAYER_FIELDS = ("return_hidden_states", "steering", "layer_taps")
_KNOWN_PARAMS = {
    *_PASSED,
    *_RENAMED,
    "seed",
    "stop",
    "logit_bias",
    "prompt",
    "messages",
    "top_logprobs_num",
    "max_completion_tokens",
    *(f for f, _ in _CONSTRAINTS),
    *(f"structured_outputs.{name}" for _, name, _ in _STRUCTURED_OUTPUTS),
}


def openai_names(body: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """Engine name -> the OpenAI name this body used (max_new_tokens came from max_completion_tokens
    when the client sent that; a constraint from the field that gave it)."""
    names = dict(_ENGINE_NAMES)
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        names["max_new_tokens"] = "max_completion_tokens"
    for field, kind, _ in _given_constraints(body):
        names[kind] = field
    return names


def _given_constraints(
    body: ChatCompletionRequest | CompletionRequest,
) -> list[tuple[str, str, Any]]:
    """(the client's field, the engine's kind, the value as sent) of each constraint the body gives."""
    found = [
        (field, kind, getattr(body, field))
        for field, kind in _CONSTRAINTS
        if getattr(body, field) is not None
    ]
    # plain text constrains nothing
    found = [f for f in found if f[0] != "response_format" or f[2].type != "text"]
    if body.structured_outputs is not None:
        found += [
            (f"structured_outputs.{name}", kind, getattr(body.structured_outputs, attr))
            for attr, name, kind in _STRUCTURED_OUTPUTS
            if getattr(body.structured_outputs, attr) not in (None, False)
        ]
    return found


def choice_regex(choices: list[str]) -> str:
    """vLLM's guided_choice as a regex: exactly one of the strings."""
    return "(" + "|".join(re.sub(r"([\\.^$|?*+()\[\]{}/-])", r"\\\1", c) for c in choices) + ")"


def constraint(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The engine's structured-output parameter ({json_schema|regex|ebnf: value}, or none) for the
    body; two constraints, in whatever names, are a 400 naming the second."""
    given = _given_constraints(body)
    if len(given) > 1:
        raise OpenAIError(
            400,
            f"give at most one of response_format (json_object or json_schema), json_schema, regex, "
            f"ebnf, guided_* and structured_outputs, got {' and '.join(f for f, _, _ in given)}",
            param=given[1][0],
        )
    if not given:
        return {}
    field, kind, value = given[0]
    if field == "response_format":
        value = response_schema(body)
    elif field.endswith("choice"):
        value = choice_regex(value)
    elif field.endswith("json_object"):
        value = {"type": "object"}
    return {kind: value}


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest, context_length: int | None = None
) -> dict[str, Any]:
    """The engine's sampling_params for an OpenAI body (unset fields keep the engine's defaults, but
    max_tokens, which takes OpenAI's: 16 for completions, what the context leaves for chat; beams
    keep theirs). max_tokens beyond the model's context is
    refused here, as OpenAI does (the engine itself would clip it to what the context leaves)."""
    fields = body.model_fields_set
    params: dict[str, Any] = {}
    for name in _PASSED:
        if name in fields and getattr(body, name) is not None:
            params[name] = getattr(body, name)
    for name, engine_name in _RENAMED.items():
        if name in fields and getattr(body, name) is not None:
            params[engine_name] = getattr(body, name)
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        params["max_new_tokens"] = body.max_completion_tokens
    if (
        "max_new_tokens" not in params
        and isinstance(body, CompletionRequest)
        and not body.use_beam_search
    ):
        # OpenAI's legacy completions default (vLLM's, SGLang's); a context shorter than it is no client's error
        params["max_new_tokens"] = min(
            COMPLETIONS_MAX_TOKENS, context_length or COMPLETIONS_MAX_TOKENS
        )
    elif "max_new_tokens" not in params and context_length is not None and not body.use_beam_search:
        # chat's default: what the context leaves. The engine shortens a max_new_tokens of the whole
        # context to what the context (and the KV pool) leave after the prompt; beams keep their default
        params["max_new_tokens"] = context_length
    limit = params.get("max_new_tokens")
    if context_length is not None and isinstance(limit, int) and limit > context_length:
        name = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None) is not None
            else "max_tokens"
        )
        raise OpenAIError(
            400,
            f"{name} is {limit}, more than the model's context of {context_length} tokens",
            param=name,
        )
    if body.seed is not None:
        if not -SEED_RANGE <= body.seed < SEED_RANGE:
            raise OpenAIError(400, f"seed must be a 64-bit integer, got {body.seed}", param="seed")
        params["seed"] = body.seed % SEED_RANGE
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise OpenAIError(
                400,
                'suffix is not supported (no fill-in-the-middle); leave it out or give ""',
                param="suffix",
            )
        if body.best_of is not None and body.best_of != body.n:
            raise OpenAIError(
                400,
                f"best_of must equal n ({body.n}): choosing the best of more samples is not supported, "
                f"got {body.best_of}",
                param="best_of",
            )
    if body.stop is not None:
        params["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    params.update(constraint(body))
    # string keys, as JSON has them: the engine's check reads them (a 400 naming logit_bias)
    if body.logit_bias:
        params["logit_bias"] = dict(body.logit_bias)
    return params


def response_schema(body: ChatCompletionRequest | CompletionRequest) -> dict | None:
    """response_format as the engine's json_schema: json_object is any JSON object."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError(
            400, "response_format json_schema needs json_schema.schema", param="response_format"
        )
    return fmt.json_schema.schema_


def openai_error(exc: ValueError, names: dict[str, str] | None = None) -> OpenAIError:
    """The engine's ValueError (it names the engine's field first) as a 400 in OpenAI's words:
    every engine name in the message becomes the client's (max_new_tokens -> max_tokens, or
    max_completion_tokens when the client sent that; input_ids -> prompt), and the first is the param."""
    names = names or _ENGINE_NAMES
    found = re.match(r"(request \d+: )?([a-z_]+)\b", str(exc))
    words = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    message = words.sub(lambda m: names.get(m.group(1), m.group(1)), str(exc))
    param = names.get(found.group(2), found.group(2)) if found else None
    if param in _LAYER_FIELDS:  # steering[0].vector -> steering.0.vector, as pydantic's paths
        path = re.match(r"(request \d+: )?([a-z_]+(?:\[\d+\]|\.[a-z_]+)*)", str(exc)).group(2)
        return OpenAIError(400, message, param=re.sub(r"\[(\d+)\]", r".\1", path))
    return OpenAIError(400, message, param=param if param in _KNOWN_PARAMS else None)


def logprob_options(body: ChatCompletionRequest | CompletionRequest) -> tuple[bool, int]:
    """(return_logprob, top_logprobs_num) for the engine."""
    if isinstance(body, ChatCompletionRequest):
        top = body.top_logprobs or 0
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        wanted = body.logprobs
    else:
        top = body.logprobs or 0
        wanted = body.logprobs is not None
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise OpenAIError(400, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param=name)
    return wanted, top


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them: text only; an assistant's refusal (a part, or
    the refusal field of a message without content) is its text."""
    out = []
    for m in body.messages:
        if isinstance(m.content, list):
            content = "".join(p.text if isinstance(p, TextPart) else p.refusal for p in m.content)
        else:
            content = m.content or ""
        out.append(
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": content or m.refusal or "",
            }
        )
    return out


def finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason["type"], "abort")


def keeps_stop(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """vLLM's include_stop_str_in_output, SGLang's no_stop_trim: the matched stop string ends the text."""
    return body.include_stop_str_in_output or body.no_stop_trim


def stop_string(meta: dict) -> str:
    """The stop string a finished request matched ("" for none: a stop token's text is in the output
    already). The engine's text ends where the match starts."""
    reason = meta.get("finish_reason") or {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    return matched if isinstance(matched, str) else ""


def usage_so_far(meta: dict, completion_tokens: int | None = None) -> dict[str, int]:
    """One choice's usage as a stream chunk's meta_info counts it (vLLM's continuous_usage_stats)."""
    prompt = meta["prompt_tokens"]
    completion = meta["completion_tokens"] if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage(results: list[dict], prompts: int, n: int) -> dict[str, int]:
    """OpenAI counts each prompt once, even with n > 1."""
    prompt = sum(results[i * n]["meta_info"]["prompt_tokens"] for i in range(prompts))
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    cached = sum(results[i * n]["meta_info"].get("cached_tokens", 0) for i in range(prompts))
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

"""Beam search over the OpenAI routes, as vLLM accepts it: extra body fields `use_beam_search`
(with `n` results), `beam_width` (default n), `length_penalty`, `early_stopping`. The engine's
Engine.beam_search does the work and the checking (a refused parameter is a 400 naming it)."""

from __future__ import annotations

from typing import Any

from engine.serve.errors import OpenAIError
from engine.serve.hidden_encoding import choice_fields
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest
from engine.serve.translate import finish_reason

BEAM_FIELDS = ("beam_width", "length_penalty", "early_stopping")


def wants_beams(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the body asks for beam search; its beam fields without use_beam_search are a 400."""
    if body.use_beam_search:
        return True
    given = [f for f in BEAM_FIELDS if getattr(body, f) is not None]
    if given:
        raise OpenAIError(
            400, f"{given[0]} is only allowed with use_beam_search: true", param=given[0]
        )
    return False


def beam_kwargs(
    body: ChatCompletionRequest | CompletionRequest, params: dict[str, Any]
) -> dict[str, Any]:
    """Engine.beam_search's keywords from an OpenAI body and its translated sampling parameters."""
    if body.stream:
        raise OpenAIError(
            400,
            "stream is not supported with use_beam_search (the beams are known at the end)",
            param="stream",
        )
    sampling = dict(params)
    n = sampling.pop("n", 1)
    width = body.beam_width if body.beam_width is not None else n
    if isinstance(width, int) and n > width:
        raise OpenAIError(
            400,
            f"n is {n}, more than beam_width {width}: a search returns at most its beams",
            param="n",
        )
    out: dict[str, Any] = {"num_return_sequences": n, "beam_width": width}
    if "max_new_tokens" in sampling:
        out["max_new_tokens"] = sampling.pop("max_new_tokens")
    if body.length_penalty is not None:
        out["length_penalty"] = body.length_penalty
    if body.early_stopping is not None:
        out["early_stopping"] = body.early_stopping
    return {**out, **sampling}


def beam_choices(results: list[dict], n: int, chat: bool) -> tuple[list[dict], dict[str, int]]:
    """Every prompt's hypotheses, best first, as choices; usage counts each prompt once. Choice j of
    prompt p has index p * n + j, as without beams, also when a grammar left fewer than n."""
    choices: list[dict] = []
    prompt = completion = 0
    for p, r in enumerate(results):
        meta = r["meta_info"]
        prompt += meta["prompt_tokens"]
        hyps = r["hypotheses"] or [
            {"text": "", "output_ids": [], "finish_reason": meta["finish_reason"]}
        ]
        for j, h in enumerate(hyps):
            completion += len(h["output_ids"])
            reason = finish_reason({"finish_reason": h["finish_reason"]})
            body = (
                {"message": {"role": "assistant", "content": h["text"]}}
                if chat
                else {"text": h["text"]}
            )
            choices.append(
                {
                    "index": p * n + j,
                    **body,
                    "finish_reason": reason,
                    "logprobs": None,
                    # the prompt's hidden states and this hypothesis's generated ones
                    **choice_fields(meta, j),
                }
            )
    return choices, {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }

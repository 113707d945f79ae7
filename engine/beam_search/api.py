"""Engine.beam_search's arguments, turned into one submission for the tokenizer manager (no torch)."""

from __future__ import annotations

from typing import Any

from engine.beam_search.params import beam_params, split_beam_kwargs

DEFAULT_BEAM_MAX_NEW_TOKENS = 32


def beam_submit_args(
    prompt: Any,
    input_ids: Any,
    messages: Any,
    rid: Any,
    trace_context: Any,
    beam_width: Any,
    max_new_tokens: Any,
    length_penalty: Any,
    early_stopping: Any,
    num_return_sequences: Any,
    sampling: dict,
) -> dict:
    """TokenizerManager.submit's keywords; ValueError naming any argument a beam search cannot take."""
    params = split_beam_kwargs(sampling)
    params["max_new_tokens"] = max_new_tokens
    beam = beam_params(beam_width, num_return_sequences, length_penalty, early_stopping)
    return dict(
        prompt=prompt,
        sampling_params=params,
        input_ids=input_ids,
        messages=messages,
        rid=rid,
        trace_context=trace_context,
        beam=beam,
    )

"""Layer fields with beam search on the session's float32 engine, against transformers: a steered
beam search equals generate(num_beams=k) with a forward hook adding the vector; the prompt's hidden
states come back with the hypotheses; per-step rows are refused up front."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from helpers import engine_idle
from test_beam_search import _same, hf_beam_search

LAYER = 12


@pytest.fixture(scope="module")
def vector(engine) -> torch.Tensor:
    hidden = engine.server_info["hidden_size"]
    return torch.randn(hidden, generator=torch.Generator().manual_seed(3)) * 4.0


def test_a_steered_beam_search_matches_transformers_with_a_hook(
    engine, hf_model, tokenizer, vector
):
    ids = tokenizer.encode(PROMPTS[1])
    steering = [{"layer": LAYER, "vector": vector.tolist()}]
    ours = engine.beam_search(input_ids=ids, beam_width=3, max_new_tokens=10, steering=steering)

    def add(module, args, output):
        return (
            (output[0] + vector,) + tuple(output[1:])
            if isinstance(output, tuple)
            else output + vector
        )

    handle = hf_model.model.layers[LAYER].register_forward_hook(add)
    try:
        ref = hf_beam_search(hf_model, ids, 3, 10)
    finally:
        handle.remove()
    _same(ours["hypotheses"], ref, tokenizer.eos_token_id)
    plain = engine.beam_search(input_ids=ids, beam_width=3, max_new_tokens=10)
    assert plain["hypotheses"][0]["output_ids"] != ours["hypotheses"][0]["output_ids"]
    assert engine_idle(engine.get_stats())  # the steered search's private K/V all went back


def test_a_beam_search_returns_its_prompts_hidden_states(engine, hf_model, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    out = engine.beam_search(
        input_ids=ids,
        beam_width=2,
        max_new_tokens=4,
        return_hidden_states={"layers": [0, LAYER], "tokens": "prompt"},
    )
    hs = out["meta_info"]["hidden_states"]
    assert hs["layers"] == [0, LAYER] and hs["prompt"].shape == (
        2,
        len(ids),
        hf_model.config.hidden_size,
    )
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(hs["layers"]):
        want = ref[layer + 1][0]
        scale = want.abs().amax(dim=-1).clamp(min=1.0)
        assert float(((hs["prompt"][j] - want).abs().amax(dim=-1) / scale).max()) <= 1e-5


def test_per_step_rows_are_refused_for_beam_search(engine, tokenizer):
    with pytest.raises(ValueError, match="return_hidden_states.tokens must be 'last' or 'prompt'"):
        engine.beam_search("Hello", beam_width=2, return_hidden_states={"tokens": "generated"})

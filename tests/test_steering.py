"""Per-request steering against transformers in float32 on the embedded SmolLM2: a vector added after a
layer gives the greedy tokens of transformers' generate with a forward hook adding it there; requests
batched beside a steered one are untouched, and so is the prefix cache; bad steering is refused."""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import torch

from conftest import PROMPTS, hf_greedy_checked
from helpers import engine_idle
from hf_reference import hf_states, hf_steered_greedy, row_error, steered


pytestmark = pytest.mark.usefixtures("one_thread_references")


NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
LAYER = 10
NORM = 60.0  # the residual stream's norm after layer 10 is about 140 on these prompts


def unit_vector(seed: int) -> torch.Tensor:
    v = torch.randn(576, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    return unit_vector(0) * NORM


def steer(vector: torch.Tensor, layer: int = LAYER, scale: float = 1.0) -> list[dict]:
    return [{"layer": layer, "vector": vector.tolist(), "scale": scale}]


def together(eng, calls: list[dict]) -> list:
    """Submit every call at once (async_generate), so their requests run in the same batches."""

    async def run() -> list:
        return await asyncio.gather(*(eng.async_generate(**c) for c in calls))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def prompts(eng) -> list[list[int]]:
    """Prompts whose greedy continuation runs past NEW tokens without an end of turn."""
    return [eng.tokenizer.encode(PROMPTS[i]) for i in (2, 3, 4, 7)]


@pytest.fixture(scope="module")
def unsteered(eng, hf_model, prompts) -> list[list[int]]:
    """transformers' greedy tokens, unsteered (checked in one pass against the engine's)."""
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    return [hf_greedy_checked(hf_model, ids, o["output_ids"], NEW) for ids, o in zip(prompts, outs)]


def test_steered_request_matches_transformers_hook_and_leaves_neighbours(
    eng, hf_model, prompts, unsteered, vector
):
    """One steered request among unsteered ones (the same prompt among them): it gets transformers'
    hooked greedy tokens, which differ from the unsteered ones; every neighbour gets its own."""
    eng.flush_cache()
    calls = [dict(input_ids=ids, sampling_params=GREEDY) for ids in prompts]
    calls.append(dict(input_ids=prompts[0], sampling_params=GREEDY, steering=steer(vector)))
    outs = together(eng, calls)
    candidate = outs[-1]["output_ids"]
    expected = hf_steered_greedy(hf_model, prompts[0], [(LAYER, vector, 1.0)], NEW, candidate)
    assert candidate == expected
    assert expected != unsteered[0]  # the vector changes the output: the test is not vacuous
    assert [o["output_ids"] for o in outs[:-1]] == unsteered
    assert engine_idle(eng.get_stats())


def test_several_layers_scales_and_negative_index(eng, hf_model, prompts, unsteered):
    """Two vectors at two layers (one named from the end) or at one layer, each with its own scale, in
    one request; every prompt steered differently in the same batch."""
    a, b = unit_vector(1) * 40.0, unit_vector(2) * 30.0
    plans = [
        [(5, a, 1.0), (20, b, -1.5)],
        [(12, b, 2.0), (12, a, -1.0)],  # two at one layer add up
        [(5, a, 0.5), (29, b, 1.0)],
    ]
    calls = []
    for ids, plan in zip(prompts[1:], plans):
        steering = [
            {"layer": layer - 30 if layer >= 20 else layer, "vector": v.tolist(), "scale": s}
            for layer, v, s in plan
        ]
        calls.append(dict(input_ids=ids, sampling_params=GREEDY, steering=steering))
    outs = together(eng, calls)
    changed = 0
    for ids, plan, out, plain in zip(prompts[1:], plans, outs, unsteered[1:]):
        expected = hf_steered_greedy(hf_model, ids, plan, NEW, out["output_ids"])
        assert out["output_ids"] == expected
        changed += expected != plain
    assert changed >= 2


def test_prefix_cache_is_neither_read_nor_written(eng, hf_model, prompts, unsteered, vector):
    """A steered request takes nothing from the cache and leaves nothing in it: the same prompt
    unsteered afterwards gets the unsteered tokens."""
    ids = prompts[3]
    eng.flush_cache()
    first = eng.generate(input_ids=ids, sampling_params=GREEDY, steering=steer(vector))
    expected = hf_steered_greedy(hf_model, ids, [(LAYER, vector, 1.0)], NEW, first["output_ids"])
    assert first["output_ids"] == expected != unsteered[3]
    after = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert after["output_ids"] == unsteered[3]
    assert after["meta_info"]["cached_tokens"] == 0  # the steered K/V were not cached
    # with the unsteered prompt now cached, a steered request still computes its own K/V
    again = eng.generate(input_ids=ids, sampling_params=GREEDY, steering=steer(vector))
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == expected
    plain = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert plain["meta_info"]["cached_tokens"] > 0 and plain["output_ids"] == unsteered[3]


def test_hidden_states_of_a_steered_request(eng, hf_model, prompts, vector):
    """The rows a steered request returns are those of transformers' steered pass; the steered layer's
    own rows include the vector (it is added before return_hidden_states reads)."""
    ids = prompts[2]
    layers = [LAYER - 1, LAYER, LAYER + 1, 29]
    out = eng.generate(
        input_ids=ids,
        sampling_params=GREEDY,
        steering=steer(vector),
        return_hidden_states={"layers": layers, "tokens": "all"},
    )
    with steered(hf_model, [(LAYER, vector, 1.0)]):
        ref = hf_states(hf_model, ids + out["output_ids"], layers, after_hooks=True)
    hs = out["meta_info"]["hidden_states"]
    p, n = len(ids), len(out["output_ids"])
    assert row_error(hs["prompt"], ref[:, :p]) <= 5e-5
    assert row_error(hs["generated"], ref[:, p - 1 : p - 1 + n]) <= 5e-5


def test_n_copies_are_each_steered(eng, hf_model, prompts, vector):
    """n > 1: every copy is steered (greedy, so all equal transformers' hooked tokens)."""
    ids = prompts[0]
    outs = eng.generate(input_ids=ids, sampling_params=dict(GREEDY, n=3), steering=steer(vector))
    candidate = outs[0]["output_ids"]
    expected = hf_steered_greedy(hf_model, ids, [(LAYER, vector, 1.0)], NEW, candidate)
    assert [o["output_ids"] for o in outs] == [expected] * 3


def test_steered_grammar_request(eng, hf_model, prompts, vector):
    """A regex request, steered: the output keeps to the regex; the steering reached the logits (its
    unconstrained tokens are transformers' hooked ones, and its constrained ones differ from the
    unsteered constrained run's or already match)."""
    regex = "[a-z ]{4,20}\\."
    params = {"max_new_tokens": 24, "temperature": 0, "regex": regex}
    ids = prompts[1]
    steered_out, plain_out = together(
        eng,
        [
            dict(input_ids=ids, sampling_params=params, steering=steer(vector, scale=2.0)),
            dict(input_ids=ids, sampling_params=params),
        ],
    )
    assert re.fullmatch(regex, steered_out["text"]), steered_out["text"]
    assert re.fullmatch(regex, plain_out["text"]), plain_out["text"]
    assert steered_out["output_ids"] != plain_out["output_ids"]


def bad_vectors() -> list:
    v = [0.0] * 576
    nan, inf = list(v), list(v)
    nan[3], inf[7] = math.nan, math.inf
    return [
        ([{"layer": 30, "vector": v}], r"steering\[0\]\.layer"),
        ([{"layer": -31, "vector": v}], r"steering\[0\]\.layer"),
        ([{"layer": 1, "vector": v}, {"layer": 2, "vector": v[:575]}], r"steering\[1\]\.vector"),
        ([{"layer": 1, "vector": v + [0.0]}], r"steering\[0\]\.vector"),
        ([{"layer": 1, "vector": nan}], r"steering\[0\]\.vector"),
        ([{"layer": 1, "vector": inf}], r"steering\[0\]\.vector"),
        ([{"layer": 1, "vector": "no-such-vector"}], r"steering\[0\]\.vector"),
        ([{"layer": 1, "vector": v, "scale": math.inf}], r"steering\[0\]\.scale"),
        ([{"layer": 1, "vector": v, "scale": "big"}], r"steering\[0\]\.scale"),
        ({"layer": 1, "vector": v}, "steering"),
    ]


@pytest.mark.parametrize("steering, field", bad_vectors())
def test_bad_steering_is_refused_up_front(eng, prompts, unsteered, steering, field):
    before = eng.get_stats()
    with pytest.raises(ValueError, match=field):
        eng.generate(input_ids=prompts[0], sampling_params=GREEDY, steering=steering)
    assert eng.get_stats()["prompt_tokens"] == before["prompt_tokens"]  # nothing was queued
    assert eng.generate(input_ids=prompts[0], sampling_params=GREEDY)["output_ids"] == unsteered[0]

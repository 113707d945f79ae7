"""Sampling parameters: each invalid value or unknown key is a ValueError naming the field, raised before
anything reaches the scheduler; valid sampling settings behave."""

from __future__ import annotations

import math

import pytest

INVALID = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"max_tokens": 5}, "unknown sampling parameter"),
    ({"temprature": 0.5}, "unknown sampling parameter"),
]


@pytest.mark.parametrize("params,field", INVALID, ids=[f"{f}:{p}" for p, f in INVALID])
def test_invalid_parameter_raises_before_queueing(engine, params, field):
    before = engine.get_stats()
    with pytest.raises(ValueError, match=field):
        engine.generate("Hello", params)
    # a batch whose second entry is bad queues nothing either
    with pytest.raises(ValueError, match=field):
        engine.generate(["Hello", "World"], [{"max_new_tokens": 4}, params])
    after = engine.get_stats()
    assert after["prompt_tokens"] == before["prompt_tokens"] and after["prefill_steps"] == before["prefill_steps"]


def test_invalid_inputs(engine):
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate("a", input_ids=[1, 2])
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[])
    with pytest.raises(ValueError, match="token id"):
        engine.generate(input_ids=[1, 2, 10**7])
    with pytest.raises(ValueError, match="sampling_params has"):
        engine.generate(["a", "b"], [{"max_new_tokens": 2}])
    with pytest.raises(ValueError, match="role"):
        engine.generate(messages=[{"content": "no role"}])


def test_greedy_equivalents(engine):
    prompt = "The three primary colors are"
    greedy = engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0})["output_ids"]
    top1 = engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0.9, "top_k": 1})["output_ids"]
    assert top1 == greedy


def test_sampling_mixed_batch_and_stop_tokens(engine, tokenizer):
    prompt = "Once upon a time"
    params = [
        {"max_new_tokens": 20, "temperature": 0},
        {"max_new_tokens": 20, "temperature": 1.0, "top_p": 0.5},
        {"max_new_tokens": 20, "temperature": 0.7, "top_k": 5},
        {"max_new_tokens": 20, "temperature": 1.3},
    ]
    outs = engine.generate([prompt] * 4, params)
    greedy = engine.generate(prompt, params[0])
    assert outs[0]["output_ids"] == greedy["output_ids"], "a greedy row changed because sampled rows share its batch"
    for o in outs:
        assert o["meta_info"]["completion_tokens"] in range(1, 21)
        assert all(0 <= t < engine.server_info["vocab_size"] for t in o["output_ids"])
    # stop at the greedy run's 5th token, given as a stop token
    stop = greedy["output_ids"][4]
    first = greedy["output_ids"].index(stop)
    out = engine.generate(prompt, {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [stop]})
    assert out["output_ids"] == greedy["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # ignore_eos keeps going past the end-of-sequence token
    long = engine.generate(prompt, {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    assert long["meta_info"]["completion_tokens"] == 30
    assert long["meta_info"]["finish_reason"] == {"type": "length", "length": 30}


def test_top_k_restricts_choices(engine):
    """With top_k=2 every sampled token is one of the two most likely at its position (checked on step 1)."""
    prompt = "My favourite animal is the"
    firsts = {
        engine.generate(prompt, {"max_new_tokens": 1, "temperature": 1.5, "top_k": 2})["output_ids"][0]
        for _ in range(12)
    }
    assert len(firsts) in (1, 2), f"top_k=2 sampled {len(firsts)} different first tokens"


def test_tiny_temperature_is_greedy_and_harms_no_neighbour(engine):
    """A temperature too small to divide by must not turn logits into NaN for the whole batch."""
    prompt = "The capital of Italy is"
    greedy = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})["output_ids"]
    outs = engine.generate([prompt, prompt], [{"max_new_tokens": 12, "temperature": 1e-50},
                                              {"max_new_tokens": 12, "temperature": 0.8}])
    assert outs[0]["output_ids"] == greedy
    assert all(o["meta_info"]["finish_reason"]["type"] in ("stop", "length") for o in outs)

"""Sampling parameters: each invalid value or unknown key is a ValueError naming the field, raised before
anything reaches the scheduler; valid sampling settings behave."""

from __future__ import annotations

import math
import reprlib

import pytest

DEEP: list = []
for _ in range(100_000):  # a RecursionError in the JSON round trip, before: not a ValueError
    DEEP = [DEEP]

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
    # a beam search's selection then failed its whole step
    (
        {"stop_token_ids": [0] * 49152},
        "stop_token_ids",
    ),
    ({"stop_token_ids": list(range(1, 1026))}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 200, "max_new_tokens": 10}, "min_new_tokens"),
    ({"min_new_tokens": 1.0}, "min_new_tokens"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    # dividing logits by it overflowed to inf
    (
        {"repetition_penalty": 1e-40},
        "repetition_penalty",
    ),
    ({"repetition_penalty": 0.001}, "repetition_penalty"),
    ({"temperature": 1e39}, "temperature"),  # inf in float32: logits / inf gave NaN, then token 0
    ({"temperature": 2e6}, "temperature"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 5]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"seed": -1}, "seed"),
    # found by tests/stress/test_hostile_input.py: was a TypeError
    (
        {0: 1, "": None},
        "names must be strings",
    ),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"n": 0}, "n must"),
    ({"n": 129}, "n must"),
    ({"n": True}, "n must"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"-5": 1.0}}, "logit_bias"),
    ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"custom_logit_processor": "no_such_processor"}, "not registered"),
    ({"custom_logit_processor": 5}, "custom_logit_processor"),
    ({"custom_logit_processor": "disallowed_tokens"}, "token_ids"),
    (
        {"custom_logit_processor": "disallowed_tokens", "custom_params": {"token_ids": [10**9]}},
        "token_ids",
    ),
    ({"custom_logit_processor": "force_token_after", "custom_params": {"token_id": 5}}, "after"),
    ({"custom_params": {"a": 1}}, "custom_logit_processor is not"),
    (
        {
            "custom_logit_processor": "disallowed_tokens",
            "custom_params": {"token_ids": [1], "x": object()},
        },
        "JSON",
    ),
    ({"custom_logit_processor": "disallowed_tokens", "custom_params": [1]}, "custom_params"),
    (
        {
            "custom_logit_processor": "disallowed_tokens",
            "custom_params": {"token_ids": [1], "deep": DEEP},
        },
        "custom_params.*JSON",
    ),
    # NaN went through the JSON round trip as null: the processor saw None, not an error
    (
        {
            "custom_logit_processor": "disallowed_tokens",
            "custom_params": {"token_ids": [1], "w": [math.nan]},
        },
        "custom_params.*finite",
    ),
    ({"max_tokens": 5}, "unknown sampling parameter"),
    ({"temprature": 0.5}, "unknown sampling parameter"),
]


@pytest.mark.parametrize(
    "params,field", INVALID, ids=[f"{f}:{reprlib.repr(p)}" for p, f in INVALID]
)
def test_invalid_parameter_raises_before_queueing(engine, params, field):
    before = engine.get_stats()
    with pytest.raises(ValueError, match=field):
        engine.generate("Hello", params)
    # a batch whose second entry is bad queues nothing either
    with pytest.raises(ValueError, match=field):
        engine.generate(["Hello", "World"], [{"max_new_tokens": 4}, params])
    after = engine.get_stats()
    assert (
        after["prompt_tokens"] == before["prompt_tokens"]
        and after["prefill_steps"] == before["prefill_steps"]
    )


REQUEST_OPTIONS = [
    ({"return_logprob": "yes"}, "return_logprob"),
    ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"return_logprob": True, "top_logprobs_num": 101}, "top_logprobs_num"),
    ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"return_logprob": True, "logprob_start_len": 1000}, "logprob_start_len"),
    ({"top_logprobs_num": 3}, "need return_logprob"),
    ({"logprob_start_len": 0}, "need return_logprob"),
]


@pytest.mark.parametrize("options,field", REQUEST_OPTIONS, ids=[f for _, f in REQUEST_OPTIONS])
def test_invalid_request_option_raises_before_queueing(engine, options, field):
    before = engine.get_stats()
    with pytest.raises(ValueError, match=field):
        engine.generate("Hello", {"max_new_tokens": 2}, **options)
    after = engine.get_stats()
    assert after["prompt_tokens"] == before["prompt_tokens"]


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
    top1 = engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0.9, "top_k": 1})[
        "output_ids"
    ]
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
    assert outs[0]["output_ids"] == greedy["output_ids"], (
        "a greedy row changed because sampled rows share its batch"
    )
    for o in outs:
        assert o["meta_info"]["completion_tokens"] in range(1, 21)
        assert all(0 <= t < engine.server_info["vocab_size"] for t in o["output_ids"])
    # stop at the greedy run's 5th token, given as a stop token
    stop = greedy["output_ids"][4]
    first = greedy["output_ids"].index(stop)
    out = engine.generate(
        prompt, {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [stop]}
    )
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
        engine.generate(prompt, {"max_new_tokens": 1, "temperature": 1.5, "top_k": 2})[
            "output_ids"
        ][0]
        for _ in range(12)
    }
    assert len(firsts) in (1, 2), f"top_k=2 sampled {len(firsts)} different first tokens"


def test_huge_top_k_means_the_whole_vocabulary_and_harms_no_neighbour(engine):
    """top_k at or past 2**63 overflowed int64 while the scheduler built the prefill step's sampling
    tensors, which aborted every request admitted in that step."""
    prompt = "The capital of Italy is"
    greedy = engine.generate(prompt, {"max_new_tokens": 3, "temperature": 0})["output_ids"]
    # a sampled token may be EOS; the test is about the abort
    sampled = {
        "max_new_tokens": 3,
        "ignore_eos": True,
    }
    outs = engine.generate(
        [prompt] * 3,
        [
            {**sampled, "top_k": 2**63},
            {**sampled, "top_k": 10**30},
            {"max_new_tokens": 3, "temperature": 0},
        ],
    )
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 3, outs
    assert outs[2]["output_ids"] == greedy


def test_n_copies_of_a_seed_near_the_top_of_its_range_run(engine):
    """Copy j of a seeded n > 1 request draws with seed + j, wrapped into [0, 2**63): the last copies of
    seed 2**63 - 1 were refused by the scheduler's arrival checks."""
    outs = engine.generate(
        "Once upon a time", {"max_new_tokens": 2, "n": 3, "seed": 2**63 - 1, "ignore_eos": True}
    )
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 3, outs
    again = engine.generate(
        "Once upon a time", {"max_new_tokens": 2, "seed": 1, "ignore_eos": True}
    )
    # copy 2 drew with (2**63 - 1 + 2) mod 2**63 = 1
    assert outs[2]["output_ids"] == again["output_ids"]


def test_tiny_temperature_is_greedy_and_harms_no_neighbour(engine):
    """A temperature too small to divide by must not turn logits into NaN for the whole batch."""
    prompt = "The capital of Italy is"
    greedy = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})["output_ids"]
    outs = engine.generate(
        [prompt, prompt],
        [{"max_new_tokens": 12, "temperature": 1e-50}, {"max_new_tokens": 12, "temperature": 0.8}],
    )
    assert outs[0]["output_ids"] == greedy
    assert all(o["meta_info"]["finish_reason"]["type"] in ("stop", "length") for o in outs)


@pytest.mark.parametrize(
    "inputs,field",
    [
        ({"prompt": "ok \ud800 then"}, "prompt"),
        ({"prompt": ["fine", "lone \udfff surrogate"]}, r"prompt\[1\]"),
        ({"messages": [{"role": "user", "content": "hi \ud83d"}]}, r"messages\[0\]\['content'\]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc80"}]}]},
            r"messages\[0\]\['content'\]\[0\]\['text'\]",
        ),
    ],
)
def test_text_that_is_not_unicode_is_refused_naming_it(engine, inputs, field):
    """A lone surrogate cannot be encoded as UTF-8: a ValueError naming where it is, before anything is
    queued (it was the tokenizer's TypeError; found trying it as a new user would)."""
    before = engine.get_stats()
    with pytest.raises(ValueError, match=field + r".*surrogate"):
        engine.generate(sampling_params={"max_new_tokens": 2}, **inputs)
    assert engine.get_stats()["prompt_tokens"] == before["prompt_tokens"]


@pytest.mark.parametrize(
    "messages,field",
    [
        ([{"role": 0, "content": None}], r"messages\[0\]\['role'\]"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\]"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["not a part"]}],
            r"messages\[1\]\['content'\]",
        ),
    ],
)
def test_chat_messages_of_the_wrong_types_are_refused_naming_them(engine, messages, field):
    """Found by tests/stress/test_hostile_input.py: a role that is not a string reached the chat
    template, whose TypeError escaped."""
    with pytest.raises(ValueError, match=field):
        engine.generate(messages=messages, sampling_params={"max_new_tokens": 2})


def test_values_that_cannot_be_sent_are_refused_and_leave_no_request_behind(engine):
    """Found by tests/stress/test_hostile_input.py: a stop string holding a lone surrogate raised the
    encoder's UnicodeEncodeError after the request was registered, which then waited forever in the
    user process. Now stop strings are checked by name, and anything else the encoder refuses (here a
    rid) unregisters the call's requests before its ValueError."""
    with pytest.raises(ValueError, match=r"stop\[1\].*surrogate"):
        engine.generate("Hi", {"max_new_tokens": 2, "stop": ["ok", "a\ud800"]})
    with pytest.raises(ValueError, match="cannot be sent"):
        engine.generate("Hi", {"max_new_tokens": 2, "n": 2}, rid="bad\udc80rid")
    assert engine.get_stats()["tracked"]["user"] == {
        "states": 0,
        "groups": 0,
        "pending_stats": 0,
        "deferred_aborts": 0,
    }


@pytest.mark.parametrize("depth", [150, 5000])
def test_a_json_schema_nested_too_deeply_is_a_value_error(depth):
    """jsonschema's check (and json itself, deeper) raised RecursionError: a 500 over HTTP, for 1 KB."""
    from engine.sampling.processors import get_logit_processor
    from engine.sampling_params import parse_sampling_params

    nested = {}
    for _ in range(depth):
        nested = {"not": nested}
    for schema in (nested, '{"not": ' * depth + "{}" + "}" * depth):
        with pytest.raises(ValueError, match="json_schema is nested too deeply"):
            parse_sampling_params({"json_schema": schema}, 49152, get_logit_processor)


def test_a_json_schema_dict_that_is_not_json_is_a_value_error():
    """A dict holding what JSON cannot write (a set, a circular reference) escaped json.dumps as a
    TypeError (ValueError for the circle) not naming json_schema."""
    from engine.sampling.processors import get_logit_processor
    from engine.sampling_params import parse_sampling_params

    circular: dict = {"type": "object"}
    circular["properties"] = {"a": circular}
    for schema in ({"enum": {1, 2}}, {"const": object()}, circular):
        with pytest.raises(ValueError, match="json_schema is not JSON"):
            parse_sampling_params({"json_schema": schema}, 49152, get_logit_processor)


def test_logit_bias_naming_one_token_twice_is_refused():
    """{"05": 2, "5": 1} (JSON keys are strings) or {5: 1, "5": 2} named token 5 twice; which bias
    applied depended on the sort of the pairs."""
    from engine.sampling.processors import get_logit_processor
    from engine.sampling_params import parse_sampling_params

    for bias in ({"05": 2, "5": 1}, {5: 1, "5": 2}):
        with pytest.raises(ValueError, match="logit_bias names token 5 twice"):
            parse_sampling_params({"logit_bias": bias}, 49152, get_logit_processor)


def test_stop_token_ids_are_deduplicated_and_bounded():
    """Every stop token id widened each beam search's selection (and every running row's stop check):
    duplicates count once, and more than MAX_STOP_TOKEN_IDS are refused naming the field."""
    from engine.sampling_params import MAX_STOP_TOKEN_IDS, parse_sampling_params

    assert parse_sampling_params({"stop_token_ids": [5, 2, 5, 5, 2, 7]}, 49152).stop_token_ids == (
        5,
        2,
        7,
    )
    assert parse_sampling_params({"stop_token_ids": 9}, 49152).stop_token_ids == (9,)
    bound = list(range(MAX_STOP_TOKEN_IDS))
    assert parse_sampling_params({"stop_token_ids": bound}, 49152).stop_token_ids == tuple(bound)
    with pytest.raises(ValueError, match=f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS}"):
        parse_sampling_params({"stop_token_ids": bound + [0]}, 49152)

"""Hostile input, by property-based testing (hypothesis): sampling parameters, request shapes, token
ids, prompts (invalid UTF-16 surrogates, control characters, empty and enormous), messages, trace
contexts and the other arguments. Each input either works or is refused with a ValueError at the
call, before anything is queued; never another exception, a crash or a hang. Accepted requests are
streamed for one chunk and left (an abort), so a huge max_new_tokens costs nothing. Afterwards the
engine is idle and still answers. ENGINE_HYPOTHESIS_EXAMPLES sets the examples per property (make
stress: 400)."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.bench.crowd import busy, wait_idle
from engine.sampling_params import FIELDS

EXAMPLES = int(os.environ.get("ENGINE_HYPOTHESIS_EXAMPLES", "25"))
VOCAB = 49152  # SmolLM2's
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
)

# surrogates included
any_char = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
texts = st.one_of(
    st.text(any_char, max_size=40),
    st.text(st.sampled_from("\x00\x07\x1b\n\r\t\u200b\ufeff\ud800"), max_size=20),
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans()
)
scalars = st.one_of(st.none(), numbers, texts)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 70000)), scalars, max_size=3),
)
param_names = st.one_of(st.sampled_from(sorted(FIELDS)), st.text(max_size=8))
edge = {  # values at and near the edges of what is allowed: numbers the sampler must survive
    "temperature": st.sampled_from([0.0, 1e-30, 1e-7, 0.01, 1.0, 100.0, 1e6, 1e30]),
    "top_p": st.sampled_from([1e-30, 1e-6, 0.5, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 2, 49151, 10**9, 2**63]),
    "min_p": st.sampled_from([0.0, 1e-9, 0.999999, 1.0]),
    "repetition_penalty": st.sampled_from([1e-9, 0.01, 0.5, 1.0, 10.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "logit_bias": st.dictionaries(
        st.integers(0, 49151), st.sampled_from([-100.0, -1e-3, 100.0]), max_size=3
    ),
    "seed": st.sampled_from([0, 1, 2**63 - 1]),
    "n": st.integers(1, 4),
    "max_new_tokens": st.sampled_from([1, 3, 2**62]),
    "min_new_tokens": st.sampled_from([0, 1, 2]),
    "ignore_eos": st.booleans(),
    "stop": st.one_of(st.just(["."]), st.lists(texts, min_size=1, max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
}
valid_sampling = st.fixed_dictionaries({}, optional=edge)
sampling = st.one_of(
    valid_sampling, valid_sampling, st.dictionaries(param_names, values, max_size=5), values
)
valid_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=30)
token_ids = st.one_of(
    valid_ids,
    valid_ids,
    st.lists(
        st.one_of(st.integers(-(2**40), 2**40), st.integers(0, 49151), numbers, texts), max_size=30
    ),
)
# valid, control characters included
plain_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)
valid_chat = st.lists(
    st.fixed_dictionaries({"role": st.just("user"), "content": plain_text}), min_size=1, max_size=2
)
messages = st.one_of(
    valid_chat,
    valid_chat,
    values,
    st.lists(
        st.one_of(
            values,
            st.dictionaries(st.sampled_from(["role", "content", "name", "x"]), values, max_size=3),
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                    "content": st.one_of(texts, values),
                }
            ),
        ),
        max_size=3,
    ),
)
trace_contexts = st.one_of(
    values,
    st.just("00-" + "0" * 32 + "-" + "0" * 16 + "-01"),
    st.text(st.sampled_from("0123456789abcdef-"), max_size=60),
)


def try_request(engine, **kwargs) -> str:
    """'refused' (ValueError at the call), or 'served' (a chunk came, then the stream was left)."""
    try:
        stream = engine.generate(stream=True, **kwargs)
    except ValueError as exc:
        assert str(exc), "a ValueError must say what is wrong"
        return "refused"
    try:
        # a few chunks: every sampled id must be a token of the vocabulary
        for i, chunk in enumerate(stream):
            assert "text" in chunk and all(
                type(t) is int and 0 <= t < VOCAB for t in chunk["output_ids"]
            ), chunk
            if i == 3:
                break
    finally:
        stream.close()
    return "served"


@pytest.fixture(scope="module")
def tally(engine):
    counts: dict[str, int] = {}
    yield counts
    stats = wait_idle(engine)
    assert not busy(stats), busy(stats)
    out = engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    assert len(out["output_ids"]) == 4  # still serving
    print("hostile inputs tried:", counts)
    # the properties explored both sides
    for key in (
        "sampling_params",
        "input_ids",
        "prompt",
        "messages",
    ):
        assert counts.get(f"{key}:served", 0) and counts.get(f"{key}:refused", 0), counts


@pytest.fixture(autouse=True)
def idle_after(engine):
    """After each property's examples: nothing of them left in any process."""
    yield
    stats = wait_idle(engine)
    if busy(stats):
        tm = engine._tm()
        left = {
            rid: (st.finish_reason, len(st.output_ids), getattr(st, "stream", None))
            for rid, st in list(tm.requests.states.items())[:5]
        }
        print("LEFT", left, dict(list(tm.requests.groups.items())[:3]))
    assert not busy(stats), busy(stats)


def _count(tally: dict, key: str, result: str) -> None:
    tally[f"{key}:{result}"] = tally.get(f"{key}:{result}", 0) + 1


@SETTINGS
@given(params=sampling)
def test_any_sampling_params(engine, tally, params):
    _count(tally, "sampling_params", try_request(engine, prompt="Hello", sampling_params=params))


@SETTINGS
@given(ids=st.one_of(token_ids, st.lists(token_ids, max_size=3), values))
def test_any_token_ids(engine, tally, ids):
    result = try_request(engine, input_ids=ids, sampling_params={"max_new_tokens": 2})
    if result == "served":  # only lists of in-range ids may be served
        flat = ids if ids and not isinstance(ids[0], list) else [i for row in ids for i in row]
        assert flat and all(type(i) is int and 0 <= i < 49152 for i in flat), ids
    _count(tally, "input_ids", result)


@SETTINGS
@given(
    prompt=st.one_of(
        plain_text,
        plain_text,
        texts,
        st.lists(texts, max_size=3),
        values,
        st.integers(0, 300_000).map(lambda n: "word " * n),
    )
)
def test_any_prompt(engine, tally, prompt):
    _count(
        tally, "prompt", try_request(engine, prompt=prompt, sampling_params={"max_new_tokens": 2})
    )


@SETTINGS
@given(chat=messages)
def test_any_messages(engine, tally, chat):
    _count(
        tally, "messages", try_request(engine, messages=chat, sampling_params={"max_new_tokens": 2})
    )


@SETTINGS
@given(
    trace=trace_contexts,
    rid=st.one_of(st.none(), values),
    top=st.one_of(st.none(), numbers),
    start=st.one_of(st.none(), numbers),
)
def test_any_other_arguments(engine, tally, trace, rid, top, start):
    kwargs = {
        "prompt": "Hi",
        "sampling_params": {"max_new_tokens": 2},
        "trace_context": trace,
        "rid": rid,
    }
    if top is not None:
        kwargs.update(return_logprob=True, top_logprobs_num=top)
    if start is not None:
        kwargs["logprob_start_len"] = start
    _count(tally, "arguments", try_request(engine, **kwargs))


def test_huge_max_new_tokens_is_bounded_by_the_context(engine):
    out = engine.generate("Hi", {"max_new_tokens": 2**62, "temperature": 0}, stream=True)
    first = next(iter(out))
    out.close()
    assert isinstance(first["output_ids"], list)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate("Hi", {"max_new_tokens": math.inf})

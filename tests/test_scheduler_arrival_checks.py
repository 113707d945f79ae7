"""Issue 13, item 4: a malformed request reaching the scheduler fails alone, with an abort naming the
field at fault; the requests batched with it and the process go on. Real ZMQ, scheduler in-process."""

from __future__ import annotations

import contextlib

import msgspec
import pytest

from engine.ipc.messages import BeamParams, TokenizedRequest
from engine.sampling_params import SamplingParams

GOOD = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
VOCAB = 49152


@pytest.fixture
def run(tiny_scheduler):
    return tiny_scheduler


BAD = {
    "logit_bias": dict(sampling=msgspec.structs.replace(GOOD, logit_bias=((10**6, 5.0),))),
    "input_ids": dict(input_ids=[1, 2, 10**6]),
    "stop_token_ids": dict(sampling=msgspec.structs.replace(GOOD, stop_token_ids=(VOCAB,))),
    "max_new_tokens": dict(sampling=msgspec.structs.replace(GOOD, max_new_tokens=0)),
    "min_new_tokens": dict(sampling=msgspec.structs.replace(GOOD, min_new_tokens=-5)),
    "top_k": dict(sampling=msgspec.structs.replace(GOOD, top_k=-7)),
    "temperature": dict(sampling=msgspec.structs.replace(GOOD, temperature=float("nan"))),
    "top_logprobs_num": dict(return_logprob=True, top_logprobs_num=10**6),
    "logprob_start_len": dict(return_logprob=True, logprob_start_len=10**6),
    "custom_logit_processor": dict(
        sampling=msgspec.structs.replace(GOOD, custom_logit_processor="no-such")
    ),
    # beam searches (issue 15)
    "beam_width": dict(beam=BeamParams(0)),
    "num_return_sequences": dict(beam=BeamParams(2, 3)),
    "early_stopping": dict(beam=BeamParams(2, 1, 1.0, "sometimes")),
    "length_penalty": dict(beam=BeamParams(2, 1, float("inf"))),
    "seed": dict(beam=BeamParams(2), sampling=msgspec.structs.replace(GOOD, seed=5)),
    "return_logprob": dict(beam=BeamParams(2), return_logprob=True),
}


@pytest.mark.parametrize("field", sorted(BAD))
def test_bad_value_fails_only_its_request(run, field):
    values = {"input_ids": [1, 2, 3], "sampling": GOOD, **BAD[field]}
    run.submit(
        TokenizedRequest(f"bad-{field}", values.pop("input_ids"), values.pop("sampling"), **values),
        TokenizedRequest(f"good-{field}", [1, 4, 5, 6], GOOD),
    )
    finishes = dict(run.finish_all())
    bad = finishes[f"bad-{field}"]
    assert bad.type == "abort" and field in bad.message, bad
    assert finishes[f"good-{field}"].type == "length"
    stats = run.sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0


def test_empty_prompt_and_too_long_prompt_are_refused(run):
    run.submit(
        TokenizedRequest("empty", [], GOOD),
        TokenizedRequest("huge", [5] * 4096, GOOD),
        TokenizedRequest("fine", [1, 2], GOOD),
    )
    finishes = dict(run.finish_all())
    assert finishes["empty"].type == "abort" and "input_ids" in finishes["empty"].message
    assert finishes["huge"].type == "abort" and "context_length" in finishes["huge"].message
    assert finishes["fine"].type == "length"


@contextlib.contextmanager
def _lending_fails_for(run, rid: str):
    """The radix cache's lend_prefix raises for request rid: schedule() fails part-way, as on a bug."""
    real = run.sched.state.kv.lend_prefix

    def lend(req):
        if req.rid == rid:
            raise KeyError("injected in schedule")
        return real(req)

    run.sched.state.kv.lend_prefix = lend
    try:
        yield
    finally:
        run.sched.state.kv.lend_prefix = real


def test_an_exception_while_scheduling_fails_only_the_requests_it_touched(run):
    """schedule() raising (here: the radix cache, on one prompt) is not fatal: that request aborts with
    the error, the running ones and later ones are served."""
    run.submit(
        TokenizedRequest("runner", [1, 9, 9], msgspec.structs.replace(GOOD, max_new_tokens=8))
    )
    assert run.sched.run_once(block=False)  # prefilled: it decodes from now on
    with _lending_fails_for(run, "cursed"):
        run.submit(TokenizedRequest("cursed", [3, 3, 3], GOOD))
        finishes = dict(run.finish_all())
    assert (
        finishes["cursed"].type == "abort" and "injected in schedule" in finishes["cursed"].message
    )
    assert finishes["runner"].type == "length"
    run.submit(TokenizedRequest("after", [1, 2], GOOD))
    assert dict(run.finish_all())["after"].type == "length"


def test_arrival_checks_do_not_parse_grammars_again(monkeypatch):
    """The user process validated the constraint (jsonschema's meta-schema check and an xgrammar parse,
    34-66 ms a request); the scheduler's receive stage, which blocks the step loop, did it again for each
    of the n copies. It checks only what could break a step: the compile fails such a request alone."""
    import engine.grammar.constraints as constraints
    from engine.scheduler.admission import check_request

    parsed: list[str] = []
    monkeypatch.setattr(constraints, "check", lambda kind, text: parsed.append(kind))
    monkeypatch.setattr(constraints, "grammar_of", lambda kind, text: parsed.append(kind))
    schema = msgspec.structs.replace(GOOD, ignore_eos=False, json_schema='{"type": "boolean"}')
    assert check_request(TokenizedRequest("g", [1, 2, 3], schema), VOCAB, 2048) is None
    assert parsed == []
    two = msgspec.structs.replace(schema, regex="a+")  # what is cheap to check still is
    assert "at most one" in check_request(TokenizedRequest("g2", [1, 2, 3], two), VOCAB, 2048)
    with_ignore_eos = msgspec.structs.replace(schema, ignore_eos=True)
    assert "ignore_eos" in check_request(
        TokenizedRequest("g3", [1, 2, 3], with_ignore_eos), VOCAB, 2048
    )


def test_an_arrival_check_that_raises_fails_only_its_request(run, monkeypatch):
    """A check raising something other than ValueError/TypeError (here a processor's validate_params)
    escaped admit_arrivals: the rest of that GenerateBatch was dropped with a log line and its callers
    waited forever."""
    from engine.sampling.processors import CustomLogitProcessor, _registry

    class Explodes(CustomLogitProcessor):
        def validate_params(self, params: dict, vocab_size: int) -> None:
            raise RuntimeError("validate_params blew up")

    monkeypatch.setitem(_registry, "explodes_on_validate", Explodes)
    odd = msgspec.structs.replace(GOOD, custom_logit_processor="explodes_on_validate")
    run.submit(
        TokenizedRequest("first", [1, 2, 3], GOOD),
        TokenizedRequest("odd", [1, 2, 3], odd),
        TokenizedRequest("last", [1, 4, 5], GOOD),
    )
    finishes = dict(run.finish_all())
    assert finishes["odd"].type == "abort" and "blew up" in finishes["odd"].message, finishes
    assert finishes["first"].type == "length" and finishes["last"].type == "length", finishes
    stats = run.sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0


def test_a_refused_request_reusing_a_running_rid_ends_the_old_one(run):
    """The user process reuses a rid only after it saw that request finish (by a stop string whose abort
    may still be on its way): the old request must end as superseded even when the new one is refused,
    or it runs on under a rid whose outputs nobody reads."""
    long = msgspec.structs.replace(GOOD, max_new_tokens=40)
    run.submit(TokenizedRequest("reused", [1, 2, 3], long, seq=1))
    assert run.sched.run_once(block=False)  # prefilled: it runs
    bad = msgspec.structs.replace(GOOD, stop_token_ids=(VOCAB,))
    run.submit(TokenizedRequest("reused", [1, 2, 3], bad, seq=2))
    finishes = run.finish_all()
    assert [(rid, f.type) for rid, f in finishes] == [("reused", "abort"), ("reused", "abort")], (
        finishes
    )
    assert "superseded" in finishes[0][1].message and "stop_token_ids" in finishes[1][1].message
    stats = run.sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0


def test_a_request_already_failed_in_admission_is_not_failed_again_when_admission_raises(
    run, monkeypatch
):
    """Admission fails a request that can never run (here: never_fits, as for a grammar that does not fit)
    and goes on; when a later request then makes it raise, the queue it fails no longer holds the first:
    one finish per request (a second would reach a later request reusing the rid)."""
    import engine.scheduler.prefill as prefill

    real_fits = prefill.never_fits
    monkeypatch.setattr(
        prefill,
        "never_fits",
        lambda sched, req: "doomed here" if req.rid == "doomed" else real_fits(sched, req),
    )
    with _lending_fails_for(run, "cursed"):
        run.submit(
            TokenizedRequest("doomed", [3, 4, 5], GOOD), TokenizedRequest("cursed", [3, 3, 3], GOOD)
        )
        finishes = run.finish_all()
    assert sorted(rid for rid, _ in finishes) == ["cursed", "doomed"], finishes
    assert "doomed here" in dict(finishes)["doomed"].message
    assert "injected in schedule" in dict(finishes)["cursed"].message

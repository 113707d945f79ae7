"""Structured output (json_schema, regex, ebnf) with xgrammar: every output valid by an independent
validator (jsonschema, re.fullmatch), in greedy, seeded sampling, n > 1 and beam search; neighbours
unaffected; streamed prefixes; bad constraints refused up front."""

from __future__ import annotations

import json
import re
import sys
import time

import jsonschema
import pytest

from engine.sampling_params import parse_sampling_params

VOCAB = 49152

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "height": {"type": "number"},
    },
    "required": ["name", "age", "colour", "address"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
SCHEMAS = [PERSON, ITEMS]
REGEXES = [r"(yes|no), because [a-z ]{1,30}\.", r"[0-9]{3}-[0-9]{4}", r"\d{4}-\d{2}-\d{2}"]
EBNF = 'root ::= num " + " num (" + " num)? " = " num\nnum ::= [1-9] [0-9]?\n'
EBNF_CHECK = r"[1-9][0-9]?( \+ [1-9][0-9]?){1,2} = [1-9][0-9]?"
PROMPT = "Describe a person as JSON."
NEW = 96


def _valid(kind: str, spec, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), spec)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return re.fullmatch(EBNF_CHECK, text) is not None


CONSTRAINTS = (
    [("json_schema", s) for s in SCHEMAS] + [("regex", r) for r in REGEXES] + [("ebnf", EBNF)]
)
IDS = ["schema-person", "schema-items", "regex-yesno", "regex-phone", "regex-date", "ebnf-sum"]


@pytest.mark.parametrize("kind,spec", CONSTRAINTS, ids=IDS)
def test_every_output_is_valid_greedy_sampled_n4_and_beams(engine, kind, spec):
    c = {kind: spec}
    greedy = engine.generate(PROMPT, {"max_new_tokens": NEW, "temperature": 0, **c})
    sampled = engine.generate(
        [PROMPT] * 2, [{"max_new_tokens": NEW, "temperature": 1.0, "seed": s, **c} for s in (1, 2)]
    )
    n4 = engine.generate(
        PROMPT, {"max_new_tokens": NEW, "temperature": 1.0, "seed": 7, "n": 4, **c}
    )
    beams = engine.beam_search(
        PROMPT, beam_width=4, max_new_tokens=NEW, num_return_sequences=4, **c
    )
    outs = [greedy, *sampled, *n4]
    for o in outs:
        # the grammar completed, then EOS
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        assert _valid(kind, spec, o["text"]), o["text"]
    assert len(beams["hypotheses"]) == 4
    for h in beams["hypotheses"]:
        assert h["finish_reason"]["type"] == "stop" and _valid(kind, spec, h["text"]), h


def test_a_grammar_with_fewer_answers_than_asked_returns_only_those(engine):
    """Regex "a" has one token path, so a search of 2 beams finds one hypothesis; the second result was
    an empty placeholder with finish reason "length" and score -1e9."""
    out = engine.beam_search(
        PROMPT, beam_width=2, max_new_tokens=4, num_return_sequences=2, regex="a"
    )
    assert [(h["text"], h["finish_reason"]["type"]) for h in out["hypotheses"]] == [
        ("a", "stop")
    ], out["hypotheses"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_unconstrained_neighbours_are_unchanged(engine):
    plain = {"max_new_tokens": 24, "temperature": 0}
    alone = engine.generate(["The quick brown fox", "def add(a, b):"], plain)
    mixed = engine.generate(
        ["The quick brown fox", PROMPT, "def add(a, b):", PROMPT],
        [
            plain,
            {"max_new_tokens": NEW, "temperature": 0, "json_schema": PERSON},
            plain,
            {"max_new_tokens": 20, "temperature": 0, "regex": REGEXES[1]},
        ],
    )
    assert [mixed[0]["output_ids"], mixed[2]["output_ids"]] == [a["output_ids"] for a in alone]
    assert _valid("json_schema", PERSON, mixed[1]["text"]) and _valid(
        "regex", REGEXES[1], mixed[3]["text"]
    )


def test_streamed_prefixes_of_a_json_output(engine):
    text, prefixes = "", []
    for chunk in engine.generate(
        PROMPT, {"max_new_tokens": NEW, "temperature": 0, "json_schema": PERSON}, stream=True
    ):
        text += chunk["text"]
        prefixes.append(text)
    assert _valid("json_schema", PERSON, text)
    assert all(text.startswith(p) for p in prefixes) and len(prefixes) > 3


def test_grammar_compiles_once_per_constraint(engine):
    before = engine.get_stats()["grammar_compile_seconds"]
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for _ in range(2):
        out = engine.generate(
            PROMPT, {"max_new_tokens": 16, "temperature": 0, "json_schema": schema}
        )
        assert _valid("json_schema", schema, out["text"])
    stats = engine.get_stats()
    assert len(stats["grammar_compile_seconds"]) == len(before) + 1
    assert stats["grammar_mask_steps"] > 0 and stats["grammar_mask_seconds"] > 0


def test_a_complete_grammar_is_not_held_open_by_min_new_tokens(engine):
    """A boolean is complete after a token or two; min_new_tokens=6 then masked the only token left
    (EOS), and the complete output ended as an abort. The grammar's completion wins over min_new_tokens."""
    outs = engine.generate(
        [PROMPT] * 2,
        [
            {
                "json_schema": {"type": "boolean"},
                "min_new_tokens": 6,
                "max_new_tokens": 12,
                "temperature": t,
            }
            for t in (0, 1.0)
        ],
    )
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert json.loads(out["text"]) in (True, False)
        assert out["meta_info"]["completion_tokens"] < 6


@pytest.mark.parametrize(
    "params,field",
    [
        ({"json_schema": PERSON, "regex": "a+"}, "at most one"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": {"type": "objekt"}}, "json_schema"),
        ({"json_schema": 5}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"regex": ""}, "regex"),
        ({"ebnf": "root ::= missing_rule"}, "ebnf"),
        ({"ebnf": "root = 'no'"}, "ebnf"),
        ({"regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        parse_sampling_params(params, VOCAB)


def test_bad_constraint_is_refused_before_anything_is_queued(engine):
    before = engine.get_stats()
    with pytest.raises(ValueError, match="regex"):
        engine.generate(
            ["Hi", "Hello"], [{"max_new_tokens": 4}, {"max_new_tokens": 4, "regex": "(("}]
        )
    after = engine.get_stats()
    assert (
        after["prompt_tokens"] == before["prompt_tokens"]
        and after["aborted_requests"] == before["aborted_requests"]
    )


def test_a_request_waiting_for_its_grammar_does_not_hold_back_the_others(tiny_scheduler):
    """In-process scheduler (tiny model): while a constraint compiles, the requests behind it are
    admitted and finish; the constrained one starts once its grammar is ready."""
    from concurrent.futures import Future

    from engine.ipc.messages import TokenizedRequest
    from engine.sampling_params import SamplingParams

    run = tiny_scheduler
    sched = run.sched
    pending: Future = Future()
    real = sched.state.grammars.request
    sched.state.grammars.request = lambda kind, text: pending  # a compile that has not finished
    try:
        plain = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        run.submit(
            TokenizedRequest(
                "constrained",
                [1, 2, 3],
                SamplingParams(max_new_tokens=8, temperature=0.0, regex="[0-9]{3}"),
            ),
            TokenizedRequest("plain", [1, 4, 5], plain),
        )
        finished = dict(run.finish_all())
        assert finished == {"plain": finished["plain"]} and finished["plain"].type == "length"
        assert [r.rid for r in sched.state.waiting] == ["constrained"]  # still waiting, not failed
        pending.set_result(real("regex", "[0-9]{3}").result())  # the real compile, now
        finished = dict(run.finish_all())
        assert finished["constrained"].type == "stop"
    finally:
        sched.state.grammars.request = real


def test_the_compiled_grammar_cache_is_bounded(monkeypatch):
    """A client sending ever new schemas must not grow the scheduler's memory: our cache of compile
    futures keeps the MAX_COMPILED most recently used constraints (a request keeps its own future),
    and the compile times the stats carry are the last MAX_COMPILED. (xgrammar's own cache: the
    next test.) The compile itself is stubbed: this is the cache's bookkeeping."""
    import engine.grammar.stage as stage

    monkeypatch.setattr(stage, "MAX_COMPILED", 3)
    grammars = stage.Grammars("unused", 10, [0])
    grammars.compile_seconds = stage.collections.deque(maxlen=3)
    monkeypatch.setattr(
        grammars,
        "_compile",
        lambda kind, text: grammars.compile_seconds.append(0.0) or (kind, text),
    )
    held = [grammars.request("regex", f"a{i}") for i in range(10)]
    assert [f.result() for f in held] == [("regex", f"a{i}") for i in range(10)]
    assert list(grammars._compiled) == [("regex", "a7"), ("regex", "a8"), ("regex", "a9")]
    assert grammars.request("regex", "a8") is held[8]  # a hit keeps it and makes it the most recent
    grammars.request("regex", "new")
    # a7 went first
    assert list(grammars._compiled) == [
        ("regex", "a9"),
        ("regex", "a8"),
        ("regex", "new"),
    ]
    assert len(grammars.compile_seconds) == 3


def test_compiles_nobody_waits_for_are_cancelled_when_a_new_one_arrives(
    tiny_scheduler, monkeypatch
):
    """One compile thread, a queue without end: compiles of requests aborted while they waited (or
    dropped from the cache) still ran, each before every constraint sent after them (2,000 distinct
    schemas at 2 ms each kept a new one waiting 4.35 s). A new constraint's arrival now cancels the
    queued compiles no waiting request holds. The compile is stubbed: the first one is held running."""
    import threading

    from engine.ipc.messages import AbortRequest, TokenizedRequest
    from engine.sampling_params import SamplingParams

    run, sched = tiny_scheduler, tiny_scheduler.sched
    grammars = sched.state.grammars
    release, compiled = threading.Event(), []

    def compile_(kind, text):
        if text == "first":
            release.wait(30)
        compiled.append(text)
        raise ValueError("stub")  # each request fails alone once its compile is done

    monkeypatch.setattr(grammars, "_compile", compile_)
    params = [SamplingParams(max_new_tokens=3, regex=text) for text in ("first", "a1", "a2", "a3")]
    run.submit(*(TokenizedRequest(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)))
    run.sched.run_once(block=False)
    queued = {r.rid: r.grammar for r in sched.state.waiting}
    run.requests.send(run.codec.encode(AbortRequest(["r1", "r2", "r3"], "gone")))
    run.submit(TokenizedRequest("new", [1, 2, 3], SamplingParams(max_new_tokens=3, regex="new")))
    for _ in range(500):  # both messages received (ZeroMQ keeps their order)
        run.sched.run_once(block=False)
        if any(r.rid == "new" for r in sched.state.waiting):
            break
        time.sleep(0.01)
    assert [queued[r].cancelled() for r in ("r0", "r1", "r2", "r3")] == [False, True, True, True]
    new = next(r.grammar for r in sched.state.waiting if r.rid == "new")
    release.set()
    for future in (queued["r0"], new):  # the loop does not wait for a compile: this test does
        future.exception(timeout=30)
    dict(run.finish_all())
    assert compiled == ["first", "new"]
    assert (
        "regex",
        "a1",
    ) not in grammars._compiled  # a cancelled compile is not served to a later request


def _wait_for_compiles(sched) -> None:
    """Until no waiting request's grammar is still compiling (the compiles run off the loop)."""
    for _ in range(500):
        if not any(r.grammar is not None and not r.grammar.done() for r in sched.state.waiting):
            return
        time.sleep(0.01)


class _Passing:
    """A plugin's grammar backend that hands every call to the real one (xgrammar's); the tests below make
    some of its calls fail. compile() keeps the constraint's text beside the compiled grammar."""

    name = "flaky"

    def __init__(self, real) -> None:
        self.real = real

    def compile(self, kind, text):
        return text, self.real.compile(kind, text)

    def matcher(self, compiled):
        return self.real.matcher(compiled[1])

    def new_bitmask(self, rows):
        return self.real.new_bitmask(rows)

    def fill_masks(self, matchers, bitmask, rows):
        self.real.fill_masks(matchers, bitmask, rows)

    def apply_masks(self, logits, bitmask, rows):
        self.real.apply_masks(logits, bitmask, rows)


def test_a_grammar_backend_failing_on_one_row_fails_that_request_alone(tiny_scheduler, monkeypatch):
    """A plugin's backend (its fill_masks, apply_masks, accept_token) is the plugin's own code: one that
    raised for one row failed the whole step, its unconstrained and constrained neighbours too."""
    from engine.ipc.messages import TokenizedRequest
    from engine.sampling_params import SamplingParams

    run, sched = tiny_scheduler, tiny_scheduler.sched
    # the matchers themselves: an id() alone is reused once one is freed
    real, bad = (
        sched.state.grammars.backend(),
        [],
    )

    class Flaky(_Passing):
        def matcher(self, compiled):
            m = real.matcher(compiled[1])
            if compiled[0] == "b+":
                bad.append(m)
            return m

        def fill_masks(self, matchers, bitmask, rows):
            if any(m is b for m in matchers for b in bad):
                raise RuntimeError("the plugin's bug")
            real.fill_masks(matchers, bitmask, rows)

    monkeypatch.setattr(sched.state.grammars, "_backend", Flaky(real))
    # compiled by Flaky
    monkeypatch.setattr(sched.state.grammars, "_compiled", type(sched.state.grammars._compiled)())
    greedy = dict(temperature=0.0, max_new_tokens=6)
    run.submit(
        TokenizedRequest("bad", [1, 2, 3], SamplingParams(regex="b+", **greedy)),
        TokenizedRequest("good", [1, 2, 3], SamplingParams(regex="[0-9]{2}", **greedy)),
        TokenizedRequest("plain", [1, 4, 5], SamplingParams(ignore_eos=True, **greedy)),
    )
    _wait_for_compiles(sched)
    finished = dict(run.finish_all())
    assert finished["bad"].type == "abort" and "the plugin's bug" in finished["bad"].message, (
        finished["bad"]
    )
    assert finished["good"].type == "stop" and finished["plain"].type == "length", finished
    # a beam search whose rows the backend fails on ends too (beside other requests: the next test)
    from engine.ipc.messages import BeamParams

    run.submit(
        TokenizedRequest(
            "beams",
            [1, 2, 3],
            SamplingParams(regex="b+", max_new_tokens=4, temperature=0.0),
            beam=BeamParams(2),
        )
    )
    _wait_for_compiles(sched)
    finished = dict(run.finish_all())
    assert finished["beams"].type == "abort" and "the plugin's bug" in finished["beams"].message, (
        finished
    )
    stats = sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0


class _Marked:
    """A matcher of a constraint the flaky backend below fails on; its forks (beams) stay marked."""

    def __init__(self, real, accepts: list) -> None:
        # accepts: [calls so far, the call that raises (0: none)]
        self.real, self.accepts = (
            real,
            accepts,
        )

    def accept_token(self, token_id: int) -> bool:
        self.accepts[0] += 1
        if self.accepts[0] == self.accepts[1]:
            raise RuntimeError("the plugin's bug")
        return self.real.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.real.is_terminated()

    def fork(self) -> "_Marked":
        return _Marked(self.real.fork(), self.accepts)


@pytest.mark.parametrize("fail_at", ["start", "decode", "first accept", "later accept"])
def test_a_grammar_backend_failing_on_a_beam_row_fails_that_search_alone(
    tiny_scheduler, monkeypatch, fail_at
):
    """A plugin's backend failing on one beam's row (its fill_masks, or a matcher's accept_token, raised)
    failed the whole step: every other request in it, plain rows and other searches, ended in abort with
    the plugin's error. The failing search ends alone, at its first selection or a later one."""
    from engine.ipc.messages import BeamParams, TokenizedRequest
    from engine.sampling_params import SamplingParams

    run, sched = tiny_scheduler, tiny_scheduler.sched
    real, calls = sched.state.grammars.backend(), {"bad": 0}
    accepts = [0, {"first accept": 1, "later accept": 4}.get(fail_at, 0)]

    class Flaky(_Passing):
        def matcher(self, compiled):
            m = real.matcher(compiled[1])
            return _Marked(m, accepts) if compiled[0] == "b+" else m

        def fill_masks(self, matchers, bitmask, rows):
            if any(isinstance(m, _Marked) for m in matchers):
                calls["bad"] += 1
                if fail_at == "start" or (fail_at == "decode" and calls["bad"] > 2):
                    raise RuntimeError("the plugin's bug")
            real.fill_masks(
                [m.real if isinstance(m, _Marked) else m for m in matchers], bitmask, rows
            )

    monkeypatch.setattr(sched.state.grammars, "_backend", Flaky(real))
    # compiled by Flaky
    monkeypatch.setattr(sched.state.grammars, "_compiled", type(sched.state.grammars._compiled)())
    greedy = dict(temperature=0.0, max_new_tokens=6)
    run.submit(
        TokenizedRequest(
            "bad", [1, 2, 3], SamplingParams(regex="b+", **greedy), beam=BeamParams(2)
        ),
        TokenizedRequest(
            "good", [1, 2, 3], SamplingParams(regex="[0-9]{2}", **greedy), beam=BeamParams(2)
        ),
        TokenizedRequest("plain", [1, 4, 5], SamplingParams(ignore_eos=True, **greedy)),
        TokenizedRequest("row", [1, 4, 6], SamplingParams(regex="[0-9]{3}", **greedy)),
    )
    _wait_for_compiles(sched)
    finished = dict(run.finish_all())
    assert finished["bad"].type == "abort" and "the plugin's bug" in finished["bad"].message, (
        finished["bad"]
    )
    assert finished["good"].type == "stop" and finished["plain"].type == "length", finished
    assert finished["row"].type == "stop", finished
    if fail_at == "decode":
        assert calls["bad"] >= 3
    elif fail_at == "start":
        assert calls["bad"] <= 2  # the batched fill, then the row alone
    else:
        assert accepts[0] == accepts[1]
    stats = sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0


def test_xgrammars_own_compiler_cache_is_bounded(model_dir):
    """xgrammar's compiler caches what it compiles, unbounded by default: ours sets its limit."""
    from engine.grammar.backend import COMPILER_CACHE_BYTES, XGrammarBackend
    from engine.tokenizer import load_hf_tokenizer

    backend = XGrammarBackend(load_hf_tokenizer(model_dir), 49152, [0])
    assert backend.compiler.cache_limit_bytes == COMPILER_CACHE_BYTES > 0


def test_a_processor_banning_all_the_grammar_allows_fails_naming_the_processor(engine):
    """Custom processors run before the grammar's mask; one that bans every token the grammar allows left
    the row all -inf, sampled as token 0, and the request ended blaming the grammar for refusing it."""
    a = engine.tokenizer.encode("a", add_special_tokens=False)
    assert len(a) == 1
    out = engine.generate(
        PROMPT,
        {
            "max_new_tokens": 4,
            "temperature": 0,
            "regex": "a",
            "custom_logit_processor": "disallowed_tokens",
            "custom_params": {"token_ids": a},
        },
    )
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "disallowed_tokens" in reason["message"], reason
    assert out["output_ids"] == []
    # the engine serves on
    ok = engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0, "regex": "a"})
    assert ok["text"] == "a"


def test_without_xgrammar_a_constraint_is_a_value_error_saying_how_to_get_it(monkeypatch):
    """xgrammar is installed with --no-deps by the Makefile, so a plain `pip install .` lacks it: a
    constraint raised ModuleNotFoundError from inside generate() (a 500 over HTTP)."""
    from engine.sampling_params import parse_sampling_params

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ValueError, match=r"needs xgrammar.*pip install --no-deps xgrammar"):
        parse_sampling_params({"regex": "a"}, 100, None)


def test_a_beam_whose_token_its_grammar_refuses_never_wins(model_dir):
    """A hook running after the grammar's mask (engine_process_logits) can put a refused token back:
    a beam took it, its matcher's accept_token said no, and the refusal was ignored; the beam went on
    from the state before the token, so its hypothesis broke the grammar (docs: every returned
    hypothesis is valid). Such a beam now drops out (-inf), as a token never allowed does."""
    import torch

    from engine.beam_search.batch import advance_matchers
    from engine.beam_search.selection import BeamSelection
    from engine.grammar.stage import Grammars
    from engine.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(model_dir)
    a, z = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("z")
    grammars = Grammars(model_dir, 49152, [tok.eos_token_id])
    try:
        start = grammars.matcher(grammars.request("regex", "ab"))
        sel = BeamSelection(2, 4, (tok.eos_token_id,))
        logprobs = torch.full((1, 49152), float("-inf"))
        logprobs[0, a], logprobs[0, z] = -0.1, -1.0  # "z": what a hook put back after the mask
        parents, tokens = sel.step(logprobs)
        matchers = advance_matchers([start], parents.tolist(), tokens.tolist(), sel)
        refused = tokens.tolist().index(z)
        assert sel.scores[refused] == float("-inf") and sel.scores[1 - refused] > -1
        assert len(matchers) == 2
    finally:
        grammars.close()


def test_a_stop_token_a_hook_puts_back_ends_no_beam_whose_grammar_is_unfinished(
    tiny_scheduler, tiny_llama_dir
):
    """engine_process_logits runs after the grammar's mask and can put a stop token back: a beam that
    took it became a finished hypothesis at once (a stop token ends a beam in the selection, before any
    matcher sees it), so the search returned text its grammar does not accept. Here the hook gives the
    stop token the best score on every beam row; the grammar ("ab") is complete only after "ab", so every
    hypothesis is "ab" then the stop token (before: the stop token alone)."""
    from engine.hooks import hookimpl
    from engine.hooks.runtime import plugin_manager, refresh, register
    from engine.ipc.messages import BeamParams, BeamSearchOut, TokenizedRequest
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import load_hf_tokenizer

    run, sched = tiny_scheduler, tiny_scheduler.sched
    tok = load_hf_tokenizer(tiny_llama_dir)
    stop = tok.eos_token_id

    class PutBack:
        @hookimpl
        def engine_process_logits(self, logits, rids, reqs, beams):
            for row, beam in enumerate(beams):
                if beam is not None:
                    logits[row, stop] = 0.0

    register(PutBack(), "putback")
    refresh()
    try:
        params = SamplingParams(regex="ab", max_new_tokens=5, temperature=0.0)
        run.submit(TokenizedRequest("beams", [1, 2, 3], params, beam=BeamParams(2)))
        sched.run_once(block=False)  # received: its grammar compiles
        _wait_for_compiles(sched)
        while sched.run_once(block=False):
            pass
        messages = run.messages()
        out = [m for m in messages if isinstance(m, BeamSearchOut)]
    finally:
        pm = plugin_manager()
        pm.unregister(pm.get_plugin("putback"))
        refresh()
    assert len(out) == 1, messages
    hyps = out[0].hypotheses
    assert hyps and all(
        h.output_ids[-1] == stop and tok.decode(h.output_ids[:-1]) == "ab" for h in hyps
    ), hyps

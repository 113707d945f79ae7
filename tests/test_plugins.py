"""Hooks and plugins on a real engine: every hook fires in the process the spec names, in stage order,
with its documented arguments; hooks that rewrite a prompt, hold a request back and change logits
visibly change the outcome; a failing hook fails only the requests it touched, naming the plugin."""

from __future__ import annotations

import json
import re
import threading
import time

from pathlib import Path

import pytest

from conftest import PROMPTS
from engine import Engine
from engine.hooks import HookError, hookimpl
from engine.hooks.loader import unload_plugins
from engine.hooks.runtime import plugin_manager, register
from engine_test_plugin import BANNED, HOLD_STEPS

PLUGIN = "engine_test_plugin:plugin"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    import os

    path = tmp_path_factory.mktemp("probe") / "events.jsonl"
    os.environ["ENGINE_TEST_PROBE"] = str(path)  # the children inherit it at spawn
    eng = Engine(
        dtype="float32", max_total_tokens=4096, plugins=PLUGIN + ",no_repeat_ngram,stagetimer"
    )
    try:
        yield eng, path
    finally:
        eng.shutdown()
        # the session's other engines must not see it in this process
        unload_plugins([PLUGIN, "no_repeat_ngram", "stagetimer"])
        os.environ.pop("ENGINE_TEST_PROBE", None)


def events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


SCHEDULER_HOOKS = (
    "engine_request_arrived",
    "engine_schedule",
    "engine_request_admitted",
    "engine_forward_before",
    "engine_forward_after",
    "engine_process_logits",
    "engine_sample_after",
    "engine_request_finished",
    "engine_step_end",
)


def test_every_hook_fires_in_its_process_in_stage_order(probe):
    eng, path = probe
    path.write_text("")
    out = eng.generate(
        PROMPTS[0], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, rid="probe-1"
    )
    assert out["meta_info"]["seen_by_test_plugin"] is True
    # engine_step_end runs after the step's output left: maybe after the result
    deadline = time.time() + 10
    while sum(e["hook"] == "engine_step_end" for e in events(path)) < 4 and time.time() < deadline:
        time.sleep(0.01)
    ev = events(path)
    pids = eng.pids
    role_of = {
        pids["user"]: "user",
        pids["scheduler"]: "scheduler",
        pids["detokenizer"]: "detokenizer",
    }
    expected_role = {
        "engine_tokenize_before": "user",
        "engine_tokenize_after": "user",
        "engine_output": "user",
        "engine_request_submitted": "user",
        "engine_request_done": "user",
        "engine_detokenize": "detokenizer",
        "engine_detokenize_after": "detokenizer",
        "engine_detokenize_output": "detokenizer",
        **{h: "scheduler" for h in SCHEDULER_HOOKS},
    }
    seen = {e["hook"] for e in ev}
    assert seen == set(expected_role), seen ^ set(expected_role)
    for e in ev:
        assert e["role"] == expected_role[e["hook"]] == role_of[e["pid"]], e

    # stage order for this request, across the three processes
    def first(hook):
        return min(e["t"] for e in ev if e["hook"] == hook)

    def last(hook):
        return max(e["t"] for e in ev if e["hook"] == hook)

    order = [
        "engine_tokenize_before",
        "engine_tokenize_after",
        "engine_request_submitted",
        "engine_request_arrived",
        "engine_schedule",
        "engine_request_admitted",
        "engine_forward_before",
        "engine_forward_after",
        "engine_process_logits",
        "engine_sample_after",
        "engine_detokenize",
        "engine_detokenize_after",
        "engine_detokenize_output",
    ]
    assert [first(h) for h in order] == sorted(first(h) for h in order)
    # after the step's output was sent: the detokenizer may already be at work on it
    assert first("engine_sample_after") <= first("engine_step_end")
    assert (
        last("engine_request_finished")
        <= last("engine_detokenize")
        <= last("engine_detokenize_output")
    )
    assert (
        last("engine_detokenize_output") <= first("engine_request_done") <= first("engine_output")
    )
    # documented arguments
    by = {h: [e for e in ev if e["hook"] == h] for h in seen}
    assert by["engine_tokenize_before"][0]["prompt"] == PROMPTS[0]
    assert by["engine_tokenize_after"][0]["n_ids"] == out["meta_info"]["prompt_tokens"]
    assert by["engine_request_admitted"][0]["rid"] == "probe-1"
    (arrived,) = by["engine_request_arrived"]
    assert (
        arrived["rid"] == "probe-1"
        and arrived["arrived_ns"] >= by["engine_request_submitted"][0]["tokenize_ns"][1]
    )
    modes = [e["mode"] for e in by["engine_forward_before"]]
    assert modes == ["extend"] + ["decode"] * 3
    assert all(
        e["logits_shape"] == [1, eng.server_info["vocab_size"]] for e in by["engine_forward_after"]
    )
    assert [t for e in by["engine_sample_after"] for t in e["next_ids"]] == out["output_ids"]
    assert [t for e in by["engine_detokenize"] for t in e["token_ids"]] == out["output_ids"]
    assert "".join(t for e in by["engine_detokenize_after"] for t in e["texts"]) == out["text"]
    assert by["engine_request_finished"][0]["finish_reason"] == {"type": "length", "length": 4}
    (submitted,) = by["engine_request_submitted"]
    assert (
        submitted["rid"] == "probe-1"
        and submitted["max_new"] == 4
        and submitted["trace_context"] == {}
    )
    assert 0 < submitted["tokenize_ns"][0] <= submitted["tokenize_ns"][1]
    (done,) = by["engine_request_done"]
    assert done["rid"] == "probe-1" and done["completion_tokens"] == 4 and done["error"] is None
    assert done["finish_reason"] == {"type": "length", "length": 4}
    steps = by["engine_step_end"]
    assert [e["mode"] for e in steps] == ["prefill"] + ["decode"] * 3
    assert all(e["rids"] == ["probe-1"] and e["error"] is None for e in steps)
    assert [e["tokens"] for e in steps] == [out["meta_info"]["prompt_tokens"], 1, 1, 1]
    for e in steps:  # wall-clock stage starts, in order
        assert e["times"] == sorted(e["times"]) and e["times"][0] > 0
    # set while processing the prefill's results
    assert steps[0]["first_token_ns"][0] >= steps[0]["times"][3]
    outputs = by["engine_detokenize_output"]
    assert "".join(t for e in outputs for t in e["texts"]) == out["text"]
    assert [f for e in outputs for f in e["finished"]] == [None] * 3 + ["length"]


def test_lifecycle_hooks_ran_in_all_three_processes(probe):
    eng, path = probe
    # the probe file was emptied by the test before; the start/ready events are in the start-up log
    # written before it, so check through a second engine started now
    path.write_text("")
    with Engine(dtype="float32", max_total_tokens=1024, plugins=PLUGIN) as second:
        pids = second.pids
    ev = events(path)
    for hook in ("engine_process_start", "engine_process_ready", "engine_process_stop"):
        roles = {e["arg_role"]: e["pid"] for e in ev if e["hook"] == hook}
        assert roles == {
            "user": pids["user"],
            "scheduler": pids["scheduler"],
            "detokenizer": pids["detokenizer"],
        }, (hook, roles)
        # the user process ran them for the second engine although the first still serves: once per Engine
        assert sorted(e["arg_role"] for e in ev if e["hook"] == hook) == [
            "detokenizer",
            "scheduler",
            "user",
        ], hook
    from engine.hooks.specs import EngineSpecs

    rows = [
        line
        for line in (Path(__file__).parent.parent / "docs" / "plugins.md").read_text().splitlines()
        if line.startswith("| lifecycle |")
    ]
    for hook, row in zip(
        ("engine_process_start", "engine_process_ready", "engine_process_stop"), rows
    ):
        # the docs say what the code does
        assert f"`{hook}`" in row and "once per Engine" in row, row
        assert "once per Engine" in " ".join(getattr(EngineSpecs, hook).__doc__.split()), hook


def test_rewrite_prompt_hook_changes_the_output(probe):
    eng, _ = probe
    params = {"max_new_tokens": 8, "temperature": 0}
    direct = eng.generate(PROMPTS[2], params)
    rewritten = eng.generate("REWRITE:" + PROMPTS[2], params)
    assert rewritten["output_ids"] == direct["output_ids"]
    assert rewritten["meta_info"]["prompt_tokens"] == direct["meta_info"]["prompt_tokens"]


def test_hold_back_hook_delays_a_request(probe):
    eng, path = probe
    path.write_text("")
    params = {"max_new_tokens": 2, "temperature": 0}
    eng.generate([PROMPTS[3], PROMPTS[4]], params, rid=["hold-a", "free-b"])
    ev = events(path)
    admitted = [e["rid"] for e in ev if e["hook"] == "engine_request_admitted"]
    assert admitted == ["free-b", "hold-a"]  # submitted first, admitted last
    held_turns = [e for e in ev if e["hook"] == "engine_schedule" and "hold-a" not in e["rids"]]
    assert len(held_turns) >= HOLD_STEPS


def test_logits_hook_changes_sampling(probe, tokenizer):
    eng, _ = probe
    params = {
        "max_new_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {BANNED: 100.0},
    }
    free = eng.generate(PROMPTS[5], params, rid="free-logits")
    banned = eng.generate(PROMPTS[5], params, rid="ban-logits")
    assert free["output_ids"] == [BANNED] * 6  # the bias makes it the only choice...
    assert BANNED not in banned["output_ids"]  # ...unless the plugin's hook removes it


def test_failing_hook_fails_only_its_requests(probe):
    eng, _ = probe
    params = {"max_new_tokens": 3, "temperature": 0}
    before = eng.get_stats()
    outs = eng.generate([PROMPTS[0], PROMPTS[1]], params, rid=["boom-1", "fine-1"])
    after = eng.get_stats()  # the refused request's prompt was never admitted: it counts nowhere
    assert after["prompt_tokens"] - before["prompt_tokens"] == outs[1]["meta_info"]["prompt_tokens"]
    assert (
        after["prompt_cache_hit_tokens"] - before["prompt_cache_hit_tokens"]
        == outs[1]["meta_info"]["cached_tokens"]
    )
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    message = outs[0]["meta_info"]["finish_reason"]["message"]
    assert PLUGIN in message and "engine_request_admitted" in message and "on purpose" in message
    assert outs[1]["meta_info"]["finish_reason"]["type"] != "abort"
    with pytest.raises(HookError, match=f"{PLUGIN}.*engine_tokenize_before"):
        eng.generate("EXPLODE now", params)
    # serves on
    assert eng.generate(PROMPTS[0], params)["meta_info"]["finish_reason"]["type"] != "abort"
    stats = eng.get_stats()
    assert stats["running"] == 0 and stats["cache_lock_refs"] == 0


def test_plugin_provides_a_logit_processor(probe):
    eng, _ = probe
    prompt = "Repeat after me: one two one two one two one two"
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    base = eng.generate(prompt, params)["output_ids"]
    bigrams = lambda ids: [tuple(ids[i : i + 2]) for i in range(len(ids) - 1)]  # noqa: E731
    assert len(set(bigrams(base))) < len(bigrams(base))  # greedy repeats itself here
    out = eng.generate(
        prompt, {**params, "custom_logit_processor": "no_repeat_ngram", "custom_params": {"n": 2}}
    )
    assert len(set(bigrams(out["output_ids"]))) == len(bigrams(out["output_ids"]))
    with pytest.raises(ValueError, match="custom_params"):
        eng.generate(
            prompt,
            {**params, "custom_logit_processor": "no_repeat_ngram", "custom_params": {"n": 0}},
        )


def test_stagetimer_reports_every_process(probe):
    from engine.plugins.stagetimer import summary

    eng, _ = probe
    eng.generate(PROMPTS[1], {"max_new_tokens": 4})
    s = summary(eng.get_stats())
    assert set(s["per_process"]) == {"user", "scheduler", "detokenizer"}
    assert (
        s["per_process"]["scheduler"]["forward"] > 0
        and s["per_process"]["detokenizer"]["detokenize"] > 0
    )
    assert s["per_process"]["user"]["tokenize"] > 0
    assert s["total"]["forward"] == s["per_process"]["scheduler"]["forward"]
    # a beam search's steps have no sampled rows (no engine_sample_after): their sample stage, the
    # beams' selection, was left open and never counted
    calls = lambda: eng.get_stats()["plugins"]["scheduler"]["stagetimer"]["calls"]  # noqa: E731
    before = calls()
    eng.beam_search(PROMPTS[1], beam_width=2, max_new_tokens=4, ignore_eos=True)
    after = calls()
    assert after["sample"] - before["sample"] == after["forward"] - before["forward"] > 0


def test_fatal_switch_makes_plugin_errors_escape(monkeypatch):
    from engine import hooks
    from engine.hooks import FatalHookError
    from engine.hooks.runtime import plugin_manager, refresh

    class Raising:
        @hooks.hookimpl
        def engine_output(self, result):
            raise RuntimeError("bad plugin")

    plugin = Raising()
    plugin_manager().register(plugin, name="raising")
    refresh()
    try:
        with pytest.raises(HookError, match="'raising' failed in hook engine_output"):
            hooks.call("engine_output", result={}, seq=0)
        monkeypatch.setenv("ENGINE_PLUGIN_ERRORS", "raise")
        with pytest.raises(FatalHookError):  # a BaseException: request isolation does not catch it
            try:
                hooks.call("engine_output", result={}, seq=0)
            except Exception:  # noqa: BLE001
                pytest.fail("a fatal plugin error was caught as an ordinary exception")
    finally:
        plugin_manager().unregister(plugin)
        refresh()


def test_bad_detokenize_result_and_failing_output_hook_fail_only_their_requests(probe):
    eng, _ = probe
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = eng.generate(PROMPTS[0], params, rid="badtexts-1")
    reason = out["meta_info"]["finish_reason"]
    assert (
        reason["type"] == "abort"
        and "engine_detokenize" in reason["message"]
        and PLUGIN in reason["message"]
    )
    outs = eng.generate([PROMPTS[1], PROMPTS[2]], params, rid=["badoutput-1", "fine-2"])
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "engine_output" in outs[0]["meta_info"]["finish_reason"]["message"]
    assert outs[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert eng.generate(PROMPTS[0], params)["meta_info"]["finish_reason"]["type"] == "length"
    stats = eng.get_stats()
    assert stats["running"] == 0 and stats["cache_lock_refs"] == 0


def test_engine_plugins_argument_overrides_the_variable(monkeypatch):
    monkeypatch.setenv("ENGINE_PLUGINS", "no_such_plugin")
    with Engine(
        dtype="float32", max_total_tokens=512, plugins=""
    ) as eng:  # the children load nothing
        assert eng.generate(PROMPTS[0], {"max_new_tokens": 2})["output_ids"]


# ------------------------------------------------------------------ beam search (issue 15)


def test_hooks_and_processors_see_beam_rows(probe):
    """A beam search's live beams are rows like any other: the logits hook sees them (with each row's
    beam index), changes them, and engine_beam_step reports every selection."""
    eng, path = probe
    path.write_text("")
    k, n = 3, 5
    params = dict(
        beam_width=k,
        max_new_tokens=n,
        num_return_sequences=k,
        ignore_eos=True,
        logit_bias={BANNED: 100.0},
    )
    free = eng.beam_search(PROMPTS[5], rid="free-beams", **params)
    banned = eng.beam_search(PROMPTS[5], rid="ban-beams", **params)
    assert BANNED in free["hypotheses"][0]["output_ids"]  # the bias makes it the best choice...
    # ...unless the hook removes it
    assert all(BANNED not in h["output_ids"] for h in banned["hypotheses"])
    ev = events(path)
    rows = [e for e in ev if e["hook"] == "engine_process_logits" and "ban-beams" in e["rids"]]
    # the first selection: the prompt's row
    assert rows[0]["beams"] == [0] and rows[0]["shape"][0] == 1
    assert all(e["beams"] == list(range(k)) and e["reqs"] == ["ban-beams"] * k for e in rows[1:])
    steps = [e for e in ev if e["hook"] == "engine_beam_step" and e["rid"] == "ban-beams"]
    assert (
        [e["step"] for e in steps]
        == list(range(1, n + 1))
        == list(range(1, banned["meta_info"]["steps"] + 1))
    )
    assert steps[0]["parents"] == [0] * k and all(
        len(e["tokens"]) == len(e["scores"]) == k for e in steps
    )
    # the trail of parents and tokens rebuilds the live beams; each hypothesis (all end at the last step:
    # no stop token) is a beam alive one step before, plus one token
    live = [[]] * k
    for e in steps[:-1]:
        live = [live[p] + [t] for p, t in zip(e["parents"], e["tokens"])]
    assert all(h["output_ids"][:-1] in live for h in banned["hypotheses"])


def test_plugin_processor_on_beams_matches_transformers(probe, hf_model, tokenizer):
    """no_repeat_ngram reads each row's own output_ids: right only if beams carry their own history."""
    from engine.plugins.no_repeat_ngram import NoRepeatNGram
    from test_beam_search import ForTransformers, _same, hf_beam_search

    eng, _ = probe
    ids = tokenizer.encode("Repeat after me: one two one two one two one two")
    params = {"n": 2}
    ours = eng.beam_search(
        input_ids=ids,
        beam_width=4,
        max_new_tokens=16,
        num_return_sequences=2,
        custom_logit_processor="no_repeat_ngram",
        custom_params=params,
    )
    adapter = ForTransformers("no_repeat_ngram", params, len(ids))
    adapter.proc = NoRepeatNGram()
    _same(
        ours["hypotheses"],
        hf_beam_search(hf_model, ids, 4, 16, 2, processors=[adapter]),
        tokenizer.eos_token_id,
    )


def test_failing_processor_or_beam_hook_fails_only_its_search(probe):
    eng, _ = probe
    results = {}

    def beam(rid: str, **extra) -> None:
        results[rid] = eng.beam_search(
            PROMPTS[7], rid=rid, beam_width=4, max_new_tokens=12, ignore_eos=True, **extra
        )

    def plain() -> None:
        results["plain"] = eng.generate(
            PROMPTS[2], {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
        )

    threads = [
        threading.Thread(
            target=beam,
            args=("explodes",),
            kwargs=dict(custom_logit_processor="explode_after", custom_params={"after": 3}),
        ),
        threading.Thread(target=beam, args=("boomstep-1",)),
        threading.Thread(target=beam, args=("fine-beams",)),
        threading.Thread(target=plain),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    exploded = results["explodes"]["meta_info"]["finish_reason"]
    assert (
        exploded["type"] == "abort"
        and "explode_after" in exploded["message"]
        and "on purpose" in exploded["message"]
    )
    hooked = results["boomstep-1"]["meta_info"]["finish_reason"]
    assert (
        hooked["type"] == "abort"
        and "engine_beam_step" in hooked["message"]
        and PLUGIN in hooked["message"]
    )
    assert results["fine-beams"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(results["fine-beams"]["hypotheses"][0]["output_ids"]) == 12
    assert results["plain"]["meta_info"]["completion_tokens"] == 16
    stats = eng.get_stats()
    assert stats["running"] == stats["beam_kv_tokens"] == stats["cache_lock_refs"] == 0
    assert stats["free_slots"] == stats["max_running_requests"]


def test_a_grammar_refusing_a_plugins_token_fails_only_that_request(probe, tokenizer):
    """A plugin that changes logits after the grammar mask can force a token the grammar refuses:
    that request ends alone, saying so; its neighbour in the step is served."""
    eng, _ = probe
    assert tokenizer.decode([BANNED]) not in "0123456789"
    outs = eng.generate(
        ["Phone:", "Phone:"],
        [{"max_new_tokens": 8, "temperature": 0, "regex": "[0-9]{3}"}] * 2,
        rid=["force-grammar", "fine-grammar"],
    )
    forced = outs[0]["meta_info"]["finish_reason"]
    assert forced["type"] == "abort" and "grammar" in forced["message"], forced
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "stop" and len(outs[1]["text"]) == 3
    stats = eng.get_stats()
    assert stats["running"] == 0 and stats["cache_lock_refs"] == 0


def test_a_processor_failing_on_one_row_fails_only_that_request(probe):
    """One batched call for every row that selected the processor; when it raises, each row is tried
    alone, so a neighbour using the same processor is served."""
    eng, _ = probe
    params = [
        {
            "max_new_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "custom_logit_processor": "explode_after",
            "custom_params": {"after": after},
        }
        for after in (2, 100)
    ]
    outs = eng.generate([PROMPTS[0], PROMPTS[1]], params)
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "on purpose" in outs[0]["meta_info"]["finish_reason"]["message"]
    assert outs[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_a_processor_raising_systemexit_fails_only_its_request(probe):
    """Before: SystemExit got past the sampler's and the step's `except Exception`, and the scheduler died."""
    eng, _ = probe
    params = [
        {
            "max_new_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "custom_logit_processor": "explode_after",
            "custom_params": {"after": after, "exit": True},
        }
        for after in (2, 100)
    ]
    outs = eng.generate([PROMPTS[0], PROMPTS[1]], params)
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "SystemExit: exited on purpose" in reason["message"], (
        reason
    )
    assert outs[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    after = eng.generate(PROMPTS[0], {"max_new_tokens": 2, "ignore_eos": True})
    assert eng.alive and after["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_a_plugin_provides_the_grammar_backend(probe):
    eng, path = probe
    path.write_text("")
    out = eng.generate(
        "Year:", {"max_new_tokens": 8, "temperature": 0, "regex": " (19|20)[0-9]{2}"}
    )
    assert re.fullmatch(" (19|20)[0-9]{2}", out["text"])
    compiles = [e for e in events(path) if e["hook"] == "grammar_compile"]
    assert compiles and compiles[-1]["kind"] == "regex" and compiles[-1]["role"] == "scheduler"


# ------------------------------------------------------------------ review fixes: isolation, services, docs


class _BrokenStats:
    """A user-process plugin whose engine_stats fails."""

    @hookimpl
    def engine_stats(self, role):
        raise RuntimeError("stats refused on purpose")


class _Reporter:
    def __init__(self) -> None:
        self.reports: list[dict] = []

    @hookimpl
    def engine_shutdown_report(self, stats):
        self.reports.append(stats)


def test_a_failing_user_stats_hook_breaks_neither_get_stats_nor_the_shutdown_report(probe):
    """Before: get_stats() raised the HookError, and with it the shutdown report (no plugin got one)."""
    from engine.frontend.engine import _shutdown_report

    eng, _ = probe
    eng.generate(PROMPTS[0], {"max_new_tokens": 2})  # figures for stagetimer in every process
    broken, reporter = _BrokenStats(), _Reporter()
    register(broken, "brokenstats")
    register(reporter, "reporter")
    try:
        stats = eng.get_stats()
        user = stats["plugins"]["user"]
        assert "'brokenstats' failed in hook engine_stats" in user["brokenstats"]["error"]
        assert "stats refused on purpose" in user["brokenstats"]["error"]
        assert user["stagetimer"]["calls"]["tokenize"] > 0  # the other plugins' figures are kept
        assert stats["plugins"]["scheduler"]["stagetimer"]["calls"]["forward"] > 0
        _shutdown_report(eng._resources.tokenizer_manager)  # what Engine.shutdown() runs first
        (report,) = reporter.reports
        assert "error" in report["plugins"]["user"]["brokenstats"]
    finally:
        for name in ("brokenstats", "reporter"):
            plugin_manager().unregister(name=name)


def test_a_hook_raising_systemexit_in_the_scheduler_fails_only_its_request(probe):
    """Before: SystemExit got past the hook isolation and the step's, and the scheduler died."""
    eng, _ = probe
    params = {"max_new_tokens": 3, "temperature": 0}
    outs = eng.generate([PROMPTS[0], PROMPTS[1]], params, rid=["exit-1", "fine-exit"])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert (
        reason["type"] == "abort" and "engine_request_admitted: SystemExit" in reason["message"]
    ), reason
    assert PLUGIN in reason["message"] and "exits on purpose" in reason["message"]
    assert outs[1]["meta_info"]["finish_reason"]["type"] != "abort"
    assert (
        eng.alive
        and eng.generate(PROMPTS[0], params)["meta_info"]["finish_reason"]["type"] != "abort"
    )


def test_a_failing_arrival_hook_fails_only_its_request(probe):
    eng, _ = probe
    params = {"max_new_tokens": 3, "temperature": 0}
    outs = eng.generate([PROMPTS[0], PROMPTS[1]], params, rid=["noarrive-1", "fine-arrive"])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert (
        reason["type"] == "abort"
        and "engine_request_arrived" in reason["message"]
        and PLUGIN in reason["message"]
    )
    assert outs[0]["meta_info"]["completion_tokens"] == 0
    assert outs[1]["meta_info"]["finish_reason"]["type"] != "abort"
    stats = eng.get_stats()
    assert stats["running"] == stats["waiting"] == stats["cache_lock_refs"] == 0


def test_noop_implements_every_hook_and_does_nothing():
    """docs/plugins.md: noop implements every hook (a template). Before: two were missing."""
    import inspect

    from engine.hooks import specs
    from engine.plugins import noop

    spec_names = {name for name in vars(specs.EngineSpecs) if name.startswith("engine_")}
    implemented = {
        name for name, fn in vars(noop).items() if getattr(fn, "engine_impl", None) is not None
    }
    assert implemented == spec_names, spec_names ^ implemented
    for name in spec_names:
        fn = getattr(noop, name)
        assert fn(**{arg: None for arg in inspect.signature(fn).parameters}) is None, name


def test_grammar_backend_hook_is_called_once_and_fatal_errors_reach_the_serving_thread(monkeypatch):
    """The hook runs in the compile thread: before, its FatalHookError stayed in the compile's Future
    (one request failed, the process went on) and after a failure it was called again per request."""
    from concurrent.futures import wait

    from engine.grammar.stage import Grammars
    from engine.hooks import FatalHookError

    calls: list[int] = []

    class FailingBackend:
        @hookimpl
        def engine_grammar_backend(self, tokenizer, vocab_size, stop_ids):
            calls.append(vocab_size)
            raise RuntimeError("no backend on purpose")

    monkeypatch.setattr("engine.tokenizer.load_hf_tokenizer", lambda model_dir: object())
    register(FailingBackend(), "failingbackend")
    grammars = Grammars("unused", 1024, [2])
    try:
        futures = [grammars.request("regex", "[0-9]"), grammars.request("regex", "[a-z]")]
        wait(futures)
        for future in futures:  # both requests fail with the one error; the hook ran once
            assert "'failingbackend' failed in hook engine_grammar_backend" in Grammars.problem(
                future, "regex"
            )
        assert calls == [1024]
        grammars.close()
        monkeypatch.setenv("ENGINE_PLUGIN_ERRORS", "raise")
        grammars = Grammars("unused", 1024, [2])
        future = grammars.request("regex", "[0-9]")
        wait([future])
        # in the thread that asks: it stops
        with pytest.raises(FatalHookError, match="no backend on purpose"):
            Grammars.problem(future, "regex")
    finally:
        grammars.close()
        plugin_manager().unregister(name="failingbackend")


def test_stagetimer_keeps_concurrent_callers_apart():
    """Two threads tokenizing at once: before, the second start overwrote the first (one shared timer
    per stage), the first stop took it, the second found none: one call counted instead of two."""
    from engine.plugins import stagetimer

    before = stagetimer.engine_stats("user")["calls"].get("tokenize", 0)
    a_started, b_started, a_stopped = threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        stagetimer.engine_tokenize_before(request=None)
        a_started.set()
        b_started.wait(10)
        stagetimer.engine_tokenize_after(request=None)
        a_stopped.set()

    def b() -> None:
        a_started.wait(10)
        stagetimer.engine_tokenize_before(request=None)
        b_started.set()
        a_stopped.wait(10)
        stagetimer.engine_tokenize_after(request=None)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert stagetimer.engine_stats("user")["calls"]["tokenize"] - before == 2


def test_forward_after_rows_and_rids_follow_the_documented_layout(probe):
    """engine_forward_after's logits: sampling rows, then beam rows, then prompt-logprob rows; in a
    decode step a beam search's rid comes once per live beam (docs/plugins.md, the hookspec)."""
    from engine.hooks.specs import EngineSpecs

    eng, path = probe
    path.write_text("")
    k = 3
    eng.beam_search(PROMPTS[6], rid="layout-beams", beam_width=k, max_new_tokens=3, ignore_eos=True)
    ev = [
        e
        for e in events(path)
        if e["hook"] == "engine_forward_after" and "layout-beams" in e["rids"]
    ]
    prefill, *decode = ev
    # the search's first row
    assert prefill["rids"] == ["layout-beams"] and prefill["logits_shape"][0] == 1
    assert len(decode) == 2 and all(
        e["rids"] == ["layout-beams"] * k and e["logits_shape"][0] == k for e in decode
    )
    out = eng.generate(
        PROMPTS[6], {"max_new_tokens": 1}, rid="layout-lp", return_logprob=True, logprob_start_len=0
    )
    (row,) = [
        e
        for e in events(path)
        if e["hook"] == "engine_forward_after" and e["rids"] == ["layout-lp"]
    ]
    # its token's row, then the prompt's
    assert row["logits_shape"][0] == 1 + out["meta_info"]["prompt_tokens"] - 1
    doc = " ".join(EngineSpecs.engine_forward_after.__doc__.split())
    assert "beam" in doc and "once per live beam" in doc
    table = next(
        line
        for line in (Path(__file__).parent.parent / "docs" / "plugins.md").read_text().splitlines()
        if line.startswith("| forward | `engine_forward_after`")
    )
    assert "beam" in table and "once per live beam" in table


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder on sys.path for plugin modules a test writes, unloaded after it."""
    import sys

    from engine.hooks.loader import loaded_plugins

    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(loaded_plugins())
    yield tmp_path
    unload_plugins([name for name in loaded_plugins() if name not in before])
    for name in [m for m in sys.modules if m.startswith("tp_")]:
        del sys.modules[name]


def test_a_misspelt_hook_name_is_refused_naming_it(plugin_dir):
    """pluggy registers an implementation of a hook nobody specifies without a word, so a plugin whose
    `engine_forward_befor` was misspelt loaded and was never called. pytest refuses such a plugin; so
    do we, naming the hook, and the plugin is not left registered."""
    from engine.hooks.loader import PluginLoadError, load_plugins, loaded_plugins

    (plugin_dir / "tp_typo").mkdir()
    (plugin_dir / "tp_typo" / "__init__.py").write_text("")
    (plugin_dir / "tp_typo" / "plugin.py").write_text(
        "from engine.hooks import hookimpl\n\n@hookimpl\ndef engine_forward_befor(batch):\n    pass\n"
    )
    with pytest.raises(PluginLoadError, match="engine_forward_befor"):
        load_plugins("tp_typo.plugin")
    assert (
        "tp_typo.plugin" not in loaded_plugins()
        and plugin_manager().get_plugin("tp_typo.plugin") is None
    )


def test_one_plugin_named_two_ways_loads_once(plugin_dir):
    """`ENGINE_PLUGINS=engine.plugins.metrics engine serve` could not start (the server adds `metrics`,
    the same module: pluggy refused it under a second name), and `ENGINE_TRACING=1` beside
    `ENGINE_PLUGINS=engine.tracing.plugin:TracingPlugin` registered two tracing plugins: every span
    twice. A plugin already loaded under another name is loaded once."""
    from engine.hooks.loader import load_plugins
    from engine.hooks.runtime import implementers

    load_plugins("noop,engine.plugins.noop")
    assert implementers("engine_step_end").count("noop") == 1
    assert "engine.plugins.noop" not in implementers("engine_step_end")
    (plugin_dir / "tp_pkg").mkdir()
    (plugin_dir / "tp_pkg" / "impl.py").write_text(
        "from engine.hooks import hookimpl\n\nclass P:\n    @hookimpl\n"
        "    def engine_step_end(self, step):\n        pass\n"
    )
    (plugin_dir / "tp_pkg" / "__init__.py").write_text("from tp_pkg.impl import P\n")
    load_plugins("tp_pkg:P,tp_pkg.impl:P")
    assert [n for n in implementers("engine_step_end") if n.startswith("tp_pkg")] == ["tp_pkg:P"]
    unload_plugins(["noop", "engine.plugins.noop"])


@pytest.mark.parametrize(
    "spec, source",
    [
        ("tp_bad.broken", "raise RuntimeError('broken at import')\n"),
        ("tp_bad.syntax", "def (\n"),
        (
            "tp_bad.ctor:P",
            "class P:\n    def __init__(self):\n        raise RuntimeError('no instance')\n",
        ),
        (":obj", None),
        (".relative", None),
    ],
)
def test_a_plugin_that_fails_to_load_is_named_in_the_error(plugin_dir, spec, source):
    """A dotted plugin whose import or construction raised escaped as the bare exception (or, in a
    child's first pass, was taken for one not installed yet): `ENGINE_PLUGINS` and the plugin went
    unnamed. Now a PluginLoadError naming it, as for an entry point."""
    from engine.hooks.loader import PluginLoadError, load_plugins, loaded_plugins

    if source is not None:
        (plugin_dir / "tp_bad").mkdir()
        (plugin_dir / "tp_bad" / "__init__.py").write_text("")
        (plugin_dir / "tp_bad" / (spec.split(":")[0].split(".")[1] + ".py")).write_text(source)
    with pytest.raises(PluginLoadError, match=re.escape(repr(spec))):
        load_plugins(spec)
    assert spec not in loaded_plugins()


def test_two_engines_ready_at_once_start_one_metrics_port(monkeypatch):
    """Two Engines started from two threads both found no metrics server and both bound
    ENGINE_METRICS_PORT: the second got `Address already in use` from its ready hook, and that
    Engine() was torn down. The port is taken once, under a lock."""
    import socket

    from engine.plugins import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("ENGINE_METRICS_PORT", str(port))
    monkeypatch.setattr(metrics, "_http", None)
    real_start, errors = None, []

    import prometheus_client

    real_start = prometheus_client.start_http_server

    def slow_start(*args, **kwargs):  # widen the window between the check and the bind
        time.sleep(0.2)
        return real_start(*args, **kwargs)

    monkeypatch.setattr(prometheus_client, "start_http_server", slow_start)
    barrier = threading.Barrier(2)

    def ready() -> None:
        barrier.wait()
        try:
            metrics.engine_process_ready(role="user", pid=0, info={})
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=ready) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert errors == []
    finally:
        if metrics._http is not None:
            server, thread = metrics._http
            server.shutdown()
            server.server_close()
            thread.join(5)


def test_stagetimer_counts_no_sample_stage_in_a_step_that_samples_nothing():
    """A prompt chunk that is not the last samples nothing: its step has no engine_sample_after, and
    stagetimer's sample stage, started at every engine_forward_after, ran to the step's end (its
    result processing counted as sampling, and a call too)."""
    import torch

    from engine.plugins import stagetimer

    before = dict(stagetimer.engine_stats("scheduler")["calls"])
    stagetimer.engine_forward_before(batch=None, rids=["a"])
    stagetimer.engine_forward_after(batch=None, rids=["a"], logits=torch.empty(0, 8))
    stagetimer.engine_step_end(step=None)
    calls = stagetimer.engine_stats("scheduler")["calls"]
    assert calls.get("forward", 0) == before.get("forward", 0) + 1
    assert calls.get("sample", 0) == before.get("sample", 0)

"""pluggy's wrappers, as every pluggy and pytest user writes them, in the engine's hook runtime (in
process): new-style `wrapper=True` and old-style `hookwrapper=True` run around the plain
implementations, see and may change their result (firstresult included), see their exceptions,
and a failure anywhere is a HookError naming the plugin; wrappers that cannot run as marked are
refused at load time."""

from __future__ import annotations

import threading

import pytest

from engine import hooks
from engine.hooks import HookError, PluginLoadError, hookimpl
from engine.hooks.loader import load_plugins, unload_plugins
from engine.hooks.runtime import register


@pytest.fixture
def plugins():
    """Register plugin objects under names; all are unregistered afterwards."""
    from engine.hooks.runtime import plugin_manager, refresh

    names = []

    def add(obj, name):
        register(obj, name)
        names.append(name)
        return obj

    yield add
    pm = plugin_manager()
    for name in names:
        obj = pm.get_plugin(name)
        if obj is not None:
            pm.unregister(obj)
    refresh()


class Plain:
    def __init__(self, value=None, fail=False):
        self.value, self.fail, self.seen = value, fail, []

    @hookimpl
    def engine_output(self, result):
        self.seen.append("plain")
        result.setdefault("order", []).append("plain")
        if self.fail:
            raise ValueError("plain broke")
        return self.value


class NewStyle:
    """Times the implementations it wraps and rewrites their result list."""

    def __init__(self):
        self.calls = 0
        self.saw_error = None

    @hookimpl(wrapper=True)
    def engine_output(self, result):
        result.setdefault("order", []).append("new:before")
        try:
            results = yield
        except HookError as exc:
            self.saw_error = exc
            raise
        result["order"].append("new:after")
        self.calls += 1
        return results + ["added by the wrapper"]


class OldStyle:
    @hookimpl(hookwrapper=True)
    def engine_output(self, result):
        result.setdefault("order", []).append("old:before")
        outcome = yield
        result["order"].append("old:after")
        result["old_saw"] = (
            outcome.get_result() if outcome.exception is None else repr(outcome.exception)
        )


def test_new_and_old_style_wrappers_run_around_the_plain_implementations(plugins):
    plugins(Plain(value=1), "plain")
    new = plugins(NewStyle(), "new")
    plugins(OldStyle(), "old")
    result: dict = {}
    out = hooks.call("engine_output", result=result, seq=0)
    # before the fix the wrappers' generators were returned as results and their bodies never ran
    assert out == [1, "added by the wrapper"]
    assert result["order"] == ["old:before", "new:before", "plain", "new:after", "old:after"]
    assert result["old_saw"] == [1, "added by the wrapper"]
    assert new.calls == 1
    assert hooks.implementers("engine_output") == ["old", "new", "plain"]


def test_a_wrapper_alone_runs_and_a_firstresult_wrapper_rewrites_the_result(plugins):
    class Upper:
        @hookimpl(wrapper=True)
        def engine_detokenize(self, rids, token_ids, finished):
            texts = yield
            return None if texts is None else [t.upper() for t in texts]

    class Decoder:
        @hookimpl
        def engine_detokenize(self, rids, token_ids, finished):
            return [f"tok{t}" for t in token_ids]

    plugins(Upper(), "upper")
    assert hooks.has("engine_detokenize")  # a wrapper alone is an implementation: it runs
    assert (
        hooks.call_first("engine_detokenize", rids=["a"], token_ids=[5], finished=[False]) is None
    )
    plugins(Decoder(), "decoder")
    assert hooks.call_first(
        "engine_detokenize", rids=["a", "b"], token_ids=[5, 6], finished=[False, True]
    ) == ["TOK5", "TOK6"]


def test_failures_are_named_and_wrappers_see_them(plugins):
    plugins(Plain(fail=True), "breaks")
    new = plugins(NewStyle(), "new")
    plugins(OldStyle(), "old")
    result: dict = {}
    with pytest.raises(
        HookError, match="plugin 'breaks' failed in hook engine_output: ValueError: plain broke"
    ) as info:
        hooks.call("engine_output", result=result, seq=0)
    assert info.value.plugin == "breaks"
    # thrown into the wrapper
    assert isinstance(new.saw_error, HookError) and new.saw_error.plugin == "breaks"
    assert "plain broke" in result["old_saw"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_wrapper_that_raises_is_named(plugins, where):
    class Broken:
        @hookimpl(wrapper=True)
        def engine_output(self, result):
            if where == "before":
                raise KeyError("set-up")
            yield
            raise RuntimeError("teardown")

    plugins(Plain(value=1), "plain")
    plugins(Broken(), "broken")
    with pytest.raises(HookError, match="plugin 'broken' failed in hook engine_output"):
        hooks.call("engine_output", result={}, seq=0)


def test_a_wrapper_may_swallow_an_inner_failure(plugins):
    class Forgiving:
        @hookimpl(wrapper=True)
        def engine_output(self, result):
            try:
                return (yield)
            except HookError:
                return ["recovered"]

    plugins(Plain(fail=True), "breaks")
    plugins(Forgiving(), "forgiving")
    assert hooks.call("engine_output", result={}, seq=0) == ["recovered"]


def test_misbehaving_wrappers_are_named(plugins):
    class Twice:
        @hookimpl(wrapper=True)
        def engine_output(self, result):
            yield
            yield

    class Never:
        @hookimpl(wrapper=True)
        def engine_sample_after(self, rids):
            if rids is not None:
                return
            yield

    plugins(Twice(), "twice")
    plugins(Never(), "never")
    with pytest.raises(HookError, match="plugin 'twice'.*yield exactly once; it yielded twice"):
        hooks.call("engine_output", result={}, seq=0)
    with pytest.raises(HookError, match="plugin 'never'.*returned without yielding"):
        hooks.call("engine_sample_after", rids=[], next_ids=None, logprobs=None)


def test_wrappers_that_cannot_run_are_refused_at_load_time(plugins):
    class NotAGenerator:
        @hookimpl(wrapper=True)
        def engine_output(self, result):
            return None

    class WrapsStats:
        @hookimpl(wrapper=True)
        def engine_stats(self, role):
            return (yield)

    with pytest.raises(PluginLoadError, match="not a generator function"):
        plugins(NotAGenerator(), "not_a_generator")
    with pytest.raises(PluginLoadError, match="engine_stats gathers one result per plugin"):
        plugins(WrapsStats(), "wraps_stats")
    # nothing left half registered
    assert not hooks.has("engine_output") and not hooks.has("engine_stats")


def test_fatal_mode_raises_past_request_isolation(plugins, monkeypatch):
    from engine.hooks import FatalHookError

    plugins(Plain(fail=True), "breaks")
    plugins(NewStyle(), "new")
    monkeypatch.setenv("ENGINE_PLUGIN_ERRORS", "raise")
    with pytest.raises(FatalHookError, match="plugin 'breaks' failed in hook engine_output"):
        hooks.call("engine_output", result={}, seq=0)


def test_wrapper_example_from_the_docs_loads_and_unloads(tmp_path, monkeypatch):
    from docs_examples import write_example

    module = write_example(tmp_path, "wrapclock")
    assert module == "myplugins.wrapclock"
    monkeypatch.syspath_prepend(str(tmp_path))
    load_plugins(module)
    try:
        assert hooks.implementers("engine_forward_after") == [module]
        result = {"meta_info": {}}
        hooks.call("engine_output", result=result, seq=0)
        assert result["meta_info"]["wrapped_in"] == "user"
        assert hooks.call_named("engine_stats", role="user")[module]["wrapped"] == 1
    finally:
        unload_plugins([module])
    assert not hooks.has("engine_forward_after")


def test_hook_specs_are_typed_and_their_types_resolve():
    """Every argument of every spec has a type, and the names imported for type checkers exist."""
    import inspect
    import typing

    import torch

    from engine.hooks import specs
    from engine.hooks.types import PromptRequest, StepRecord
    from engine.ipc.messages import BatchTextOut
    from engine.sampling_params import SamplingParams
    from engine.scheduler.request import Req
    from engine.model.forward_batch import ForwardBatch

    names = {
        "torch": torch,
        "PromptRequest": PromptRequest,
        "StepRecord": StepRecord,
        "BatchTextOut": BatchTextOut,
        "SamplingParams": SamplingParams,
        "Req": Req,
        "ForwardBatch": ForwardBatch,
    }
    hooks_seen = 0
    for name, fn in vars(specs.EngineSpecs).items():
        if not name.startswith("engine_"):
            continue
        hooks_seen += 1
        hints = typing.get_type_hints(fn, globalns={**vars(specs), **names})
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        assert set(params) | {"return"} == set(hints), (name, params, hints)
        if getattr(fn, "engine_spec", {}).get("firstresult"):
            assert "first non-None result" in fn.__doc__, name
    assert hooks_seen >= 20


def test_the_docs_table_of_environment_variables_is_the_registry():
    """docs/configuration.md holds engine/envvars.py's table, and no ENGINE_* variable is read elsewhere."""
    import re
    from pathlib import Path

    from engine.envvars import VARIABLES, table

    root = Path(__file__).resolve().parent.parent
    assert table() in (root / "docs" / "configuration.md").read_text()
    readers = re.compile(
        r"""environ(?:\.get)?\(\s*["'](ENGINE_[A-Z_]+)|environ\[\s*["'](ENGINE_[A-Z_]+)"""
    )
    for path in root.joinpath("engine").rglob("*.py"):
        if path.name in ("envvars.py", "sitecustomize.py") or path.name.startswith("bench"):
            continue
        for found in readers.findall(path.read_text()):
            name = next(n for n in found if n)
            assert name in VARIABLES, (
                f"{path.relative_to(root)} reads {name}, which engine/envvars.py does not list"
            )
            assert False, f"{path.relative_to(root)} reads {name} itself: use engine.envvars.read"


def test_engine_env_never_prints_the_api_key():
    import os
    import subprocess
    import sys

    env = {**os.environ, "ENGINE_API_KEY": "sekrit-value-42", "ENGINE_TRACE_STEPS": "3"}
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "env"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0
    assert "ENGINE_API_KEY=<set>" in out.stdout and "sekrit" not in out.stdout
    assert "ENGINE_TRACE_STEPS=3" in out.stdout and "| `ENGINE_PLUGINS` |" in out.stdout


# ------------------------------------------------------------------ exceptions that are not Exception


class Exits:
    """A plain implementation that raises the given exception (SystemExit, ...)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    @hookimpl
    def engine_output(self, result):
        raise self.exc


class WrapperExits:
    def __init__(self, exc: BaseException, where: str) -> None:
        self.exc, self.where = exc, where

    @hookimpl(wrapper=True)
    def engine_sample_after(self, rids, next_ids, logprobs):
        if self.where == "before":
            raise self.exc
        yield
        raise self.exc


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit(), BaseException("odd")])
def test_a_hook_raising_systemexit_or_any_baseexception_is_a_named_hook_error(plugins, exc):
    """Before the fix only Exception was caught: a plugin's sys.exit() left the hook unnamed and, in the
    scheduler, got past the step's isolation and killed the process (every request failed)."""
    plugins(Exits(exc), "exits")
    with pytest.raises(
        HookError, match=f"plugin 'exits' failed in hook engine_output: {type(exc).__name__}"
    ):
        hooks.call("engine_output", result={}, seq=0)
    for where in ("before", "after"):
        name = f"wrapper_exits_{where}"
        plugins(WrapperExits(exc, where), name)
        with pytest.raises(
            HookError,
            match=f"plugin '{name}' failed in hook engine_sample_after: {type(exc).__name__}",
        ):
            hooks.call("engine_sample_after", rids=[], next_ids=None, logprobs=None)
        from engine.hooks.runtime import plugin_manager, refresh

        plugin_manager().unregister(name=name)
        refresh()


def test_keyboard_interrupt_stops_the_user_process_but_is_a_hook_error_in_a_child(plugins):
    """Ctrl-C in the user process must stop the caller, not fail a request; the children ignore SIGINT,
    so there a KeyboardInterrupt can only be a plugin's own raise: isolated like any error."""
    from engine.hooks import FatalHookError, set_role

    plugins(Exits(KeyboardInterrupt()), "interrupts")
    assert hooks.current_role() == "user"
    with pytest.raises(KeyboardInterrupt):
        hooks.call("engine_output", result={}, seq=0)
    caught: list[
        BaseException
    ] = []  # another thread of the user process (the async submit worker): no Ctrl-C there

    def call_in_thread() -> None:
        try:
            hooks.call("engine_output", result={}, seq=0)
        except BaseException as exc:  # noqa: BLE001 - what the call raised is the test's subject
            caught.append(exc)

    worker = threading.Thread(target=call_in_thread)
    worker.start()
    worker.join()
    assert (
        len(caught) == 1
        and isinstance(caught[0], HookError)
        and "KeyboardInterrupt" in str(caught[0])
    )
    set_role("scheduler")
    try:
        with pytest.raises(
            HookError, match="plugin 'interrupts' failed in hook engine_output: KeyboardInterrupt"
        ):
            hooks.call("engine_output", result={}, seq=0)
    finally:
        set_role("user")
    # the project's own fatal error passes unchanged
    plugins(Exits(FatalHookError("stop now")), "fatal")
    with pytest.raises(FatalHookError, match="stop now"):
        hooks.call("engine_output", result={}, seq=0)


class _After:
    """A plugin of the hooks that come after the fact, failing or not."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.seen = fail, []

    @hookimpl
    def engine_request_done(self, rid, meta_info, error):
        self.seen.append(rid)
        if self.fail:
            raise ValueError("done broke")

    @hookimpl
    def engine_process_stop(self, role, pid):
        self.seen.append(role)
        if self.fail:
            raise ValueError("stop broke")


def test_one_plugin_failing_after_the_fact_does_not_keep_the_event_from_the_others(
    plugins, caplog, monkeypatch
):
    """pluggy stops at the first implementation that raises: a broken plugin's engine_process_stop kept
    the tracing plugin after it from flushing its spans, its engine_request_done from ending a root span.
    The error is logged (on stderr outside pytest, which takes the records), named, and the others run;
    a wrapper still sees the call end."""
    good = plugins(_After(fail=False), "good")
    plugins(_After(fail=True), "broken")  # registered last: called first
    hooks.call("engine_request_done", rid="r1", meta_info={}, error=None, seq=1)
    hooks.call("engine_process_stop", role="user", pid=1)
    assert good.seen == ["r1", "user"]
    err = caplog.text
    assert "plugin 'broken' failed in hook engine_request_done: ValueError: done broke" in err
    assert "plugin 'broken' failed in hook engine_process_stop: ValueError: stop broke" in err
    monkeypatch.setenv("ENGINE_PLUGIN_ERRORS", "raise")  # fatal mode still stops at once
    from engine.hooks import FatalHookError

    with pytest.raises(FatalHookError, match="done broke"):
        hooks.call("engine_request_done", rid="r2", meta_info={}, error=None, seq=2)
    assert good.seen == ["r1", "user"]


def test_plugins_load_in_their_order_when_some_can_only_load_in_the_strict_pass(
    tmp_path, monkeypatch
):
    """A child's sitecustomize pass (strict=False) skipped a plugin it could not import yet and loaded the
    ones after it; the strict pass then registered the skipped one last, so pluggy called it first: the
    processes disagreed on call order (which firstresult hook wins, how wrappers nest)."""
    import sys

    code = (
        "from engine.hooks import hookimpl\n\nclass P:\n    @hookimpl\n"
        "    def engine_output(self, result):\n        pass\n\nplugin = P()\n"
    )
    late, early = tmp_path / "late", tmp_path / "early"
    for folder, module in ((late, "order_late_plugin"), (early, "order_early_plugin")):
        folder.mkdir()
        (folder / f"{module}.py").write_text(code)
    spec = "order_late_plugin:plugin,order_early_plugin:plugin"
    # the late one is importable only later (next to the script)
    monkeypatch.syspath_prepend(str(early))
    try:
        load_plugins(spec, strict=False)
        monkeypatch.syspath_prepend(str(late))
        load_plugins(spec)
        # last registered first
        assert hooks.implementers("engine_output") == [
            "order_early_plugin:plugin",
            "order_late_plugin:plugin",
        ]
    finally:
        unload_plugins(spec.split(","))
        for module in ("order_late_plugin", "order_early_plugin"):
            sys.modules.pop(module, None)


def test_an_entry_point_plugin_that_fails_to_import_is_named(monkeypatch):
    from engine.hooks import loader

    class Broken:
        name = "broken-ep"

        def load(self):
            raise ModuleNotFoundError("No module named 'its_dependency'")

    monkeypatch.setattr(loader, "entry_points", lambda group: [Broken()])
    with pytest.raises(
        PluginLoadError,
        match="plugin 'broken-ep' cannot be imported: ModuleNotFoundError: .*its_dependency",
    ):
        load_plugins("broken-ep")

"""Process-wide state under threads (issue 13, item 10): two Engines started from two threads leave
os.environ as it was (no child's PYTHONPATH or role left behind) and each serves with its plugins;
the hook table rebuilt while another thread calls hooks never makes a call miss an
implementation."""

from __future__ import annotations

import os
import threading

from engine import hooks
from engine.hooks import hookimpl
from engine.hooks.loader import unload_plugins
from engine.hooks.runtime import plugin_manager, refresh, register


def test_two_engines_started_from_two_threads_leave_the_environment_clean(
    tiny_llama_dir, monkeypatch
):
    from engine import Engine

    monkeypatch.setenv("PYTHONPATH", "/some/user/path")
    before = dict(os.environ)
    for _ in range(2):
        barrier = threading.Barrier(2)
        engines, failures = [], []

        def start() -> None:
            try:
                barrier.wait()
                engines.append(
                    Engine(
                        model_path=tiny_llama_dir,
                        dtype="float32",
                        max_total_tokens=1024,
                        plugins="noop",
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=start) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        try:
            assert not failures, failures
            # neither start hung
            assert len(engines) == 2 and not any(t.is_alive() for t in threads)
            # before the lock: PYTHONPATH kept a sitecustomize entry
            assert dict(os.environ) == before
            for eng in engines:
                out = eng.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
                assert out["meta_info"]["completion_tokens"] == 2
                assert set(eng.get_stats()["plugins"]) == {"user", "scheduler", "detokenizer"}
        finally:
            for eng in engines:
                eng.shutdown()
    unload_plugins(["noop"])


class _Counter:
    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def engine_output(self, result):
        self.calls += 1


class _Other:
    @hookimpl
    def engine_output(self, result):
        return None


def test_rebuilding_the_hook_table_never_hides_an_implementation():
    counter = _Counter()
    register(counter, "always-there")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            register(_Other(), "churn")
            pm = plugin_manager()
            pm.unregister(pm.get_plugin("churn"))
            refresh()

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        made = 0
        for _ in range(20000):
            hooks.call("engine_output", result={}, seq=0)
            made += 1
    finally:
        stop.set()
        worker.join(30)
        pm = plugin_manager()
        pm.unregister(counter)
        refresh()
    assert counter.calls == made  # before: a call during clear() and rebuild saw no implementation

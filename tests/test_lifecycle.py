"""Start-up failures, shutdown, and death of a child or the parent: no hang, no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine import Engine, EngineDeadError, EngineStartError
from helpers import pid_alive, wait_gone, wait_path_gone

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"dtype": "float32", "max_total_tokens": 4096, "max_running_requests": 8}


def test_runtime_dir_private_and_removed_at_shutdown():
    with Engine(**SMALL) as eng:
        runtime_dir = eng.runtime_dir
        assert oct(os.stat(runtime_dir).st_mode & 0o777) == "0o700"
        assert sorted(os.listdir(runtime_dir)) == ["detokenizer", "scheduler", "tokenizer"]
        children = [eng.pids["scheduler"], eng.pids["detokenizer"]]
        assert all(pid_alive(p) for p in children)
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1
    assert not os.path.exists(runtime_dir)
    assert wait_gone(children, 5) == []
    with pytest.raises(EngineDeadError):
        eng.generate("Hi")


def test_process_titles_and_ctrl_c_does_not_kill_children():
    with Engine(**SMALL) as eng:
        for role in ("scheduler", "detokenizer"):
            cmdline = (
                Path(f"/proc/{eng.pids[role]}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            )
            assert cmdline.startswith(f"engine::{role}")
            # what a terminal's Ctrl-C sends to the whole group
            os.kill(eng.pids[role], signal.SIGINT)
        time.sleep(0.5)
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1


def test_sigterm_to_the_whole_group_leaves_the_children_to_the_parent():
    """`timeout`, systemd's stop and `kill -- -PGID` send SIGTERM to every process of the group: the
    children died of it at once, so `engine serve` never drained its requests (they failed with "the
    scheduler process died") and a script's socket directory stayed in /tmp. Like Ctrl-C, it is the
    parent's to act on: the children serve on, and stop when the parent stops them or dies."""
    with Engine(**SMALL) as eng:
        children = [eng.pids["scheduler"], eng.pids["detokenizer"]]
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1
        runtime_dir = eng.runtime_dir
    assert wait_gone(children, 10) == []
    assert not os.path.exists(runtime_dir)


def test_scheduler_sigkill_mid_generation_raises_engine_dead():
    eng = Engine(**SMALL)
    runtime_dir = eng.runtime_dir
    sched, detok = eng.pids["scheduler"], eng.pids["detokenizer"]
    caught: list[BaseException] = []

    def run():
        try:
            eng.generate("Count to one thousand:", {"max_new_tokens": 3000, "ignore_eos": True})
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    os.kill(sched, signal.SIGKILL)
    worker.join(10)
    assert not worker.is_alive(), "the caller still waits on a dead engine"
    assert time.monotonic() - t0 < 10
    assert caught and isinstance(caught[0], EngineDeadError), caught
    assert "scheduler" in str(caught[0])
    with pytest.raises(EngineDeadError):
        eng.generate("again")
    assert wait_gone([sched, detok], 10) == []
    assert wait_path_gone(runtime_dir, 5)
    eng.shutdown()


def _run_script(body: str) -> subprocess.Popen:
    header = "import json, os, sys, time\nfrom engine import Engine\nif __name__ == '__main__':\n"
    script = header + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    ")
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def test_a_script_read_from_stdin_starts_an_engine(tiny_llama_dir):
    """`python - <<EOF`: spawn re-runs the parent's main script in each child by its path, and a script
    from stdin has the path '<stdin>', which no child can open: the scheduler died before it was ready."""
    script = textwrap.dedent(f"""
        from engine import Engine
        with Engine(model_path={tiny_llama_dir!r}, dtype="float32", max_total_tokens=1024) as eng:
            out = eng.generate(input_ids=[1, 2, 3], sampling_params={{"max_new_tokens": 2, "temperature": 0}})
        print(len(out["output_ids"]))
    """)
    res = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip() == "2", res.stderr[-2000:]


def test_parent_sigkill_takes_children_down():
    proc = _run_script(
        """
        eng = Engine(dtype="float32", max_total_tokens=2048, max_running_requests=4)
        print(json.dumps({"pids": eng.pids, "dir": eng.runtime_dir}), flush=True)
        time.sleep(600)
        """
    )
    info = json.loads(proc.stdout.readline())
    children = [info["pids"]["scheduler"], info["pids"]["detokenizer"]]
    assert all(pid_alive(p) for p in children)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert wait_gone(children, 10) == [], "children outlived a SIGKILLed parent"
    assert wait_path_gone(info["dir"], 5), "runtime directory left behind"


def test_atexit_stops_children_without_shutdown_call():
    proc = _run_script(
        """
        eng = Engine(dtype="float32", max_total_tokens=2048, max_running_requests=4)
        print(json.dumps({"pids": eng.pids, "dir": eng.runtime_dir}), flush=True)
        """
    )
    info = json.loads(proc.stdout.readline())
    assert proc.wait(60) == 0
    assert wait_gone([info["pids"]["scheduler"], info["pids"]["detokenizer"]], 10) == []
    assert not os.path.exists(info["dir"])


def test_atexit_closes_the_engine_before_multiprocessing_stops_its_children(tiny_llama_dir):
    """Interpreter exit runs atexit handlers last registered first: weakref.finalize's (the engine's
    close) is registered when the process makes its first finalizer, so a script that made one before
    importing the engine (a tempfile.TemporaryDirectory) had multiprocessing's handler run first. It
    SIGTERMed the children: no shutdown report, no stop hooks in them (now that they ignore SIGTERM, it
    would wait for them forever). The engine's close is registered with atexit itself, after it."""
    script = textwrap.dedent(f"""
        import json, tempfile
        keep = tempfile.TemporaryDirectory()  # the process's first weakref.finalize, before the engine's imports
        from engine import Engine
        if __name__ == "__main__":
            eng = Engine(model_path={tiny_llama_dir!r}, dtype="float32", max_total_tokens=1024, plugins="stagetimer")
            eng.generate(input_ids=[1, 2, 3], sampling_params={{"max_new_tokens": 2, "temperature": 0}})
            print(json.dumps({{"pids": eng.pids, "dir": eng.runtime_dir}}), flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            children = _children_of(proc.pid)
            proc.kill()
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            proc.communicate()
    info = json.loads(out.splitlines()[0])
    assert proc.returncode == 0, err[-2000:]
    assert (
        "stagetimer: seconds per stage" in err
        and "scheduler" in err.split("stagetimer: seconds per stage")[1]
    ), err[-2000:]
    assert wait_gone([info["pids"]["scheduler"], info["pids"]["detokenizer"]], 10) == []
    assert not os.path.exists(info["dir"])


def test_an_engine_left_open_in_a_multiprocessing_worker_lets_the_worker_exit(
    tiny_llama_dir, tmp_path
):
    """A multiprocessing worker runs no atexit handlers: when its target ends, multiprocessing SIGTERMs
    its daemonic children and joins them. With the engine's children ignoring SIGTERM (the parent's to
    decide), an engine still referenced there (a global, or a frame a traceback keeps) hung the worker
    for good. The engine's close is one of multiprocessing's own exit finalizers, run before that."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, multiprocessing, sys
        from engine import Engine

        def work(queue):
            global ENGINE
            ENGINE = Engine(model_path={tiny_llama_dir!r}, dtype="float32", max_total_tokens=1024)
            queue.put(dict(ENGINE.pids))

        if __name__ == "__main__":
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            worker = ctx.Process(target=work, args=(queue,))
            worker.start()
            pids = queue.get(timeout=120)
            worker.join(60)
            print(json.dumps({{"pids": pids, "exitcode": worker.exitcode}}), flush=True)
            if worker.exitcode is None:
                worker.kill()
    """)
    )
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    info = json.loads(res.stdout.splitlines()[-1])
    children = [info["pids"]["scheduler"], info["pids"]["detokenizer"]]
    try:
        assert info["exitcode"] == 0, res.stderr[-2000:]
        assert wait_gone(children, 10) == []
    finally:
        for pid in children:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_fork_of_the_user_process_does_not_close_its_engine(tiny_llama_dir):
    """A program that forks (os.fork) with an engine open: the fork inherits the engine's finalizer,
    and its exit ran the close, stopping children that are not its own (an AssertionError from
    multiprocessing, after failing the parent's waiting requests in the fork and closing its copy of
    the sockets). The close belongs to the process that started the engine."""
    with Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024) as eng:
        runtime_dir = eng.runtime_dir
        pid = os.fork()
        if pid == 0:  # the fork: what its exit would run
            code = 0
            try:
                eng._finalizer()
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, done
        assert os.path.exists(runtime_dir)
        out = eng.generate(
            input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0}
        )
        assert len(out["output_ids"]) == 2


def test_corrupt_weights_report_child_error_promptly(tmp_path, model_dir):
    for name in os.listdir(model_dir):
        if name != "model.safetensors" and not name.startswith("."):
            (tmp_path / name).write_bytes((Path(model_dir) / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    before = set(_children_of(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024)
    assert time.monotonic() - t0 < 60
    assert "scheduler" in str(info.value) and "safetensors" in str(info.value).lower()
    assert wait_gone(set(_children_of(os.getpid())) - before, 10) == []


def test_an_engine_whose_ready_hook_fails_is_shut_down(tiny_llama_dir):
    """engine_process_ready ran after the engine counted as started: its HookError left Engine() with
    both children running, no handle to stop them, and the engine among live_engines()."""
    from engine.frontend.engine import live_engines
    from engine.hooks import HookError, hookimpl
    from engine.hooks.runtime import plugin_manager

    class NotReady:
        @hookimpl
        def engine_process_ready(self, role, pid, info):
            raise RuntimeError("no port for the metrics")

    before, engines = set(_children_of(os.getpid())), set(map(id, live_engines()))
    plugin = NotReady()
    plugin_manager().register(plugin, name="not-ready")
    try:
        with pytest.raises(HookError, match="not-ready.*engine_process_ready.*no port"):
            Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024)
    finally:
        plugin_manager().unregister(plugin)
    assert wait_gone(set(_children_of(os.getpid())) - before, 10) == []
    assert set(map(id, live_engines())) == engines


def test_a_context_length_past_the_models_is_refused_not_cut(tiny_llama_dir):
    """It became the model's max_position_embeddings unseen; long prompts were then refused naming a
    context_length the caller never gave."""
    with pytest.raises(
        EngineStartError,
        match=r"context_length=1000000 is more than the model's max_position_embeddings \(\d+\)",
    ):
        Engine(
            model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024, context_length=10**6
        )


def test_bad_model_path_raises_before_spawning(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(model_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(not_an_option=1)
    with pytest.raises(ValueError, match="dtype"):
        Engine(dtype="float16x")


@pytest.mark.parametrize(
    "option, value",
    [
        # passed as float("0.5"), then int * str in the scheduler: a string of 3x free RAM
        (
            "mem_fraction",
            "0.5",
        ),
        ("mem_fraction", True),
        ("mem_fraction", float("nan")),
        ("mem_fraction", 1.0),
        ("startup_timeout", "5"),  # a TypeError from the comparison, not the ValueError promised
        ("startup_timeout", float("nan")),
        ("startup_timeout", float("inf")),
        ("startup_timeout", 0),
    ],
)
def test_bad_number_options_are_value_errors_naming_them(option, value):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"^{option} must be"):
        EngineConfig.from_kwargs(**{option: value})


@pytest.mark.parametrize(
    "name, value",
    [
        ("ENGINE_NATIVE_KERNELS", "no"),
        ("ENGINE_TRACING", "yes"),
        ("ENGINE_PLUGIN_ERRORS", "yes"),
        ("ENGINE_NATIVE_KERNELS", "off"),
    ],
)
def test_a_switch_set_to_a_value_it_does_not_take_stops_the_start_naming_it(
    monkeypatch, name, value
):
    """docs/configuration.md: bad values stop the start naming the variable. These compared with one
    value ("0", "1", "raise") and took anything else as the default, without a word."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name}='{value}' is not supported"):
        Engine(dtype="float32", max_total_tokens=1024)


def test_scheduler_blocks_when_idle():
    import psutil

    with Engine(**SMALL) as eng:
        eng.generate("Hi", {"max_new_tokens": 2})
        proc = psutil.Process(eng.pids["scheduler"])
        time.sleep(0.5)
        before = sum(proc.cpu_times()[:2])
        time.sleep(2.0)
        used = sum(proc.cpu_times()[:2]) - before
    assert used < 0.2, f"idle scheduler used {used:.2f}s of CPU in 2s: it spins"


def _children_of(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def test_an_engine_collected_in_a_thread_holding_its_lock_closes_without_deadlock(tiny_llama_dir):
    """An engine in a reference cycle is closed by whichever thread's allocation runs the collector: in
    a thread holding the tokenizer manager's lock (a caller registering requests, the receiver thread),
    the close took that non-reentrant lock again and waited for good. A collected engine closes in a
    thread of its own."""
    import gc

    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024)
    eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0})
    children = [eng.pids["scheduler"], eng.pids["detokenizer"]]
    lock = eng._resources.tokenizer_manager.requests.lock
    eng.cycle = eng  # only the collector frees it
    del eng
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        with lock:
            gc.collect()
        done.set()

    worker = threading.Thread(target=collect_holding_the_lock, daemon=True)
    worker.start()
    assert done.wait(30), "the collector's close waited for a lock its own thread held"
    assert wait_gone(children, 30) == []


@pytest.mark.parametrize(
    "name, value, override",
    [
        ("ENGINE_PACK_WEIGHTS", "0", "torch-plain=on"),
        ("ENGINE_FUSED_DECODE", "0", "fused-decode=off"),
    ],
)
def test_a_retired_kernel_switch_stops_the_start_naming_its_override(
    monkeypatch, name, value, override
):
    """The per-kernel switches became kernel_overrides rows: set to a value that changed something,
    one was read by nothing, and an A/B run compared a path with itself without a word."""
    from engine import envvars

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name} is retired: .*{override}"):
        envvars.check_switches()
    monkeypatch.setenv(name, "1")  # the old default changed nothing: still fine
    envvars.check_switches()

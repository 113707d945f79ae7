"""Parent-side process management: spawn, wait for ready (never hang), stop."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import multiprocessing.connection
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from engine.errors import EngineStartError


@dataclass
class Child:
    role: str
    process: mp.Process
    conn: multiprocessing.connection.Connection
    info: dict = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.process.pid


# The folder whose sitecustomize.py installs plugins in the children (put first on their PYTHONPATH).
SITECUSTOMIZE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sitecustomize"
)


def clean_inherited_env() -> None:
    """In a child, once started: what spawn_child set for this child alone leaves its environment,
    so that a process the child starts in turn is not taken for an engine process."""
    os.environ.pop("ENGINE_PROCESS_ROLE", None)
    path = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != SITECUSTOMIZE_DIR
    ]
    if path:
        os.environ["PYTHONPATH"] = os.pathsep.join(path)
    else:
        os.environ.pop("PYTHONPATH", None)


# multiprocessing's spawn passes no environment of its own: the child copies os.environ as it is
# at start. Changing it for one start is process-wide, so starts take this lock (two Engines
# started from two threads cannot see each other's PYTHONPATH), and nothing else that inherits
# os.environ is started inside the window (the resource tracker is started before it).
_spawn_lock = threading.Lock()


@contextlib.contextmanager
def _main_script_or_none():
    """spawn has each child run the parent's main script again, by its path, unless main was a module
    (`python -m`). A script read from stdin (`python - <<EOF`) has the path '<stdin>', which no child can
    open: the child exits before it starts. For such a main the start goes without the path, as for
    `python -c`; a real script keeps its re-run (its definitions may be what the child's plugins need)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    # as spawn resolves it
    where = os.path.join(mp.process.ORIGINAL_DIR or "", path) if path is not None else None
    if main is None or where is None or spec_name is not None or os.path.isfile(where):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def spawn_child(
    role: str, target: Callable, args: tuple, env: dict[str, str] | None = None
) -> Child:
    """Start target(*args, conn) in a fresh interpreter ("spawn": CUDA and threads make fork unsafe).
    `env` is set for the child only, with ENGINE_PROCESS_ROLE=role so that plugins know the role
    from interpreter start; the child removes both from its own environment (run_child)."""
    from multiprocessing import resource_tracker

    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=True)
    level = logging.getLogger("engine").getEffectiveLevel()
    process = ctx.Process(
        target=_child_main,
        args=(level, target, *args, child_conn),
        name=f"engine::{role}",
        daemon=True,
    )
    env = {**(env or {}), "ENGINE_PROCESS_ROLE": role}
    with _spawn_lock:
        resource_tracker.ensure_running()  # outside the window: it must not inherit the child's variables
        saved = {k: os.environ.get(k) for k in env}
        try:
            os.environ.update(env)
            with _main_script_or_none():
                process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    child_conn.close()  # the child holds the only other end: EOF there means we are gone
    return Child(role=role, process=process, conn=parent_conn)


def _child_main(level: int, target: Callable, *args) -> None:
    """In the child: the engine logger's level as the parent had it at the start (so silencing it there
    silences the children too; handlers cannot travel, so records go to the child's stderr), then the body."""
    logging.getLogger("engine").setLevel(level)
    target(*args)


def _read_status(child: Child) -> dict | None:
    try:
        if child.conn.poll(0):
            return msgspec.json.decode(child.conn.recv_bytes())
    except (EOFError, OSError):
        return None
    return None


def wait_ready(
    children: list[Child],
    timeout: float,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> None:
    """Block until every child reports ready; raise EngineStartError with the child's error otherwise."""
    deadline = time.monotonic() + timeout
    pending = {c.role: c for c in children}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineStartError(
                f"{', '.join(pending)} not ready after {timeout:.0f}s (startup_timeout)"
            )
        handles = [c.conn for c in pending.values()] + [
            c.process.sentinel for c in pending.values()
        ]
        for handle in multiprocessing.connection.wait(handles, timeout=remaining):
            for child in list(pending.values()):
                if handle is child.conn:
                    try:
                        status = msgspec.json.decode(child.conn.recv_bytes())
                    except (EOFError, OSError):
                        continue  # the sentinel reports the death
                    _handle_status(child, status, pending, on_progress)
                elif handle == child.process.sentinel and child.role in pending:
                    status = _read_status(child)
                    while status is not None and status.get("status") == "progress":
                        status = _read_status(child)
                    if status is not None:
                        _handle_status(child, status, pending, on_progress)
                    if child.role in pending:
                        child.process.join(1)
                        raise EngineStartError(
                            f"{child.role} process exited with code {child.process.exitcode} before it was ready"
                        )


def _handle_status(child: Child, status: dict, pending: dict, on_progress) -> None:
    kind = status.get("status")
    if kind == "progress":
        if on_progress is not None:
            on_progress(child.role, int(status["done"]), int(status["total"]))
    elif kind == "ready":
        child.info = status.get("info", {})
        pending.pop(child.role, None)
    elif kind == "failed":
        raise EngineStartError(
            f"{child.role} process failed to start: {status.get('error')}\n{status.get('traceback', '')}"
        )


def stop_children(children: list[Child], timeout: float = 5.0) -> None:
    """Ask politely over the pipe, then SIGKILL (children ignore SIGTERM: it is the parent's); always reap."""
    for child in children:
        if child.process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                child.conn.send_bytes(b"shutdown")
    deadline = time.monotonic() + timeout
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.process.is_alive():
            child.process.kill()
            child.process.join(2)
        with contextlib.suppress(OSError):
            child.conn.close()

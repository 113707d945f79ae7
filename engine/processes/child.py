"""Child-side life cycle: title, readiness report, and exit when the parent stops or dies.

The readiness pipe doubles as a lifeline: the parent holds the only other end, so EOF on it means the
parent is gone (even after SIGKILL) and the child exits at once. Messages on it are JSON, never pickle.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import threading
import time
import traceback
from typing import Callable, Protocol

import msgspec

logger = logging.getLogger(__name__)


class Serving(Protocol):
    info: dict

    def serve_forever(self) -> None: ...


def send_status(conn, **payload) -> None:
    conn.send_bytes(msgspec.json.encode(payload))


def _exit_now(code: int) -> None:
    os._exit(code)  # skip interpreter teardown: torch and zmq threads may still be busy


def _watch_parent(conn, parent_pid: int, runtime_dir: str | None) -> None:
    while True:
        parent_gone = False
        try:
            if conn.poll(1.0):
                if conn.recv_bytes() == b"shutdown":
                    _process_hook("engine_process_stop")
                    _exit_now(0)
                continue
        except (EOFError, OSError):
            parent_gone = True  # the parent closed its end or died
        if not parent_gone and os.getppid() == parent_pid:
            continue
        if runtime_dir:  # the parent cannot clean up any more: its sockets' directory goes with us
            shutil.rmtree(runtime_dir, ignore_errors=True)
        _exit_now(0)


def _process_hook(name: str, **kwargs) -> None:
    from engine import hooks

    if hooks.has(name):
        try:
            hooks.call(name, role=hooks.current_role(), pid=os.getpid(), **kwargs)
        except BaseException as exc:  # noqa: BLE001 - a stop hook must not keep the process alive
            logger.error("engine::%s: %s", hooks.current_role(), exc)


def run_child(
    role: str,
    conn,
    parent_pid: int,
    build: Callable[[Callable[[int, int], None]], Serving],
    runtime_dir: str | None = None,
    title: str | None = None,
) -> None:
    """Entry body for a spawned child: build the role's object, report ready or failed, then serve.
    title: the process title, engine::<role> unless given (a tensor-parallel rank's), followed by the
    name of the engine's socket directory."""
    # Ctrl-C, and the SIGTERM of `timeout`, systemd's stop or `kill -- -PGID`, reach the whole process
    # group; the parent decides when children stop (over the pipe), and they go when it dies (the lifeline).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from engine.processes.launch import clean_inherited_env

    clean_inherited_env()
    with contextlib.suppress(ImportError):
        import setproctitle

        # the engine's socket directory names it: one user process may hold several engines
        tag = f" {os.path.basename(runtime_dir)}" if runtime_dir else ""
        setproctitle.setproctitle((title or f"engine::{role}") + tag)
    threading.Thread(
        target=_watch_parent, args=(conn, parent_pid, runtime_dir), name="parent-watch", daemon=True
    ).start()

    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] > 0.05:
            last[0] = now
            send_status(conn, status="progress", role=role, done=done, total=total)

    try:
        from engine import hooks
        from engine.hooks.loader import install_from_env

        hooks.set_role(role)
        # idempotent: what sitecustomize loaded stays, the rest loads now
        install_from_env(strict=True)
        if hooks.has("engine_process_start"):
            hooks.call("engine_process_start", role=role, pid=os.getpid())
        server = build(progress)
        gc.collect()  # the build's own garbage, then what it built (it lives as long as the process) out of
        gc.freeze()  # sight of every later full collection
        if hooks.has("engine_process_ready"):
            hooks.call("engine_process_ready", role=role, pid=os.getpid(), info=server.info)
    except BaseException as exc:  # report anything, even MemoryError, then exit non-zero
        text = "".join(traceback.format_exception(exc)).rstrip()
        try:
            send_status(
                conn,
                status="failed",
                role=role,
                error=f"{type(exc).__name__}: {exc}",
                traceback=text,
            )
        finally:
            _exit_now(1)
        return
    send_status(conn, status="ready", role=role, pid=os.getpid(), info=server.info)
    try:
        server.serve_forever()
    except BaseException:
        traceback.print_exc()
        _exit_now(1)
    _exit_now(0)

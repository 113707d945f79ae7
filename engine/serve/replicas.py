"""`engine serve --dp N`: N replicas of the server on free loopback ports and the SGLang model gateway
in front of them on --host/--port, as `sglang_router.launch_server --dp N` did (docs/scale-out.md).

Each replica is a whole `engine serve` (its own three processes) given the same engine options.
The launcher supervises: SIGTERM or SIGINT stops the gateway first (no new requests), then the
replicas (each finishes its requests within --shutdown-timeout); any child that exits on its own
stops all the others and the launcher exits 1, so a supervisor restarts the deployment. Children
get SIGTERM should the launcher itself die (Linux's parent-death signal): no process is left.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.serve import gateway

log = logging.getLogger("engine.serve")

READY = re.compile(r"engine serve: ready on (http://\S+) ")
GATEWAY_START_TIMEOUT = 60.0  # the gateway registers already-running workers within seconds
LOADS_TIMEOUT = 10.0  # its load poll comes every gateway.LOAD_MONITOR_INTERVAL seconds


@dataclass
class Child:
    """One child process and the lines it printed, forwarded with its name in front."""

    name: str
    proc: subprocess.Popen
    url: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)


PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl, looked up in the launcher (not between fork and exec, where a loader lock
    another thread held could never be released); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def _child_setup(prctl):
    """In the child before exec: SIGTERM when the launcher dies, and a process group of its own, so
    a terminal's Ctrl-C reaches the launcher alone, which stops the children in order."""

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def _spawn(name: str, argv: list[str], env: dict | None = None) -> Child:
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        preexec_fn=_child_setup(_prctl()),
    )
    child = Child(name, proc)

    def forward() -> None:
        for line in proc.stdout:
            found = READY.search(line)
            if found and child.url is None:
                child.url = found.group(1)
                child.ready.set()
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()
        child.ready.set()  # exited: whoever waits learns it from poll()

    threading.Thread(target=forward, name=f"forward-{name}", daemon=True).start()
    return child


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_argv(engine_argv: Sequence[str], threads: int | None) -> list[str]:
    """One replica's command: the server's own flags (less --host and --port, which the launcher
    sets: loopback, a port the system picks), and a share of the cores unless --num-threads is given."""
    argv = [
        sys.executable,
        "-m",
        "engine.serve",
        *engine_argv,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    if threads is not None:
        argv += ["--num-threads", str(threads)]
    return argv


@dataclass
class Deployment:
    replicas: list[Child]
    gateway: Child | None = None

    def children(self) -> list[Child]:
        return [c for c in [self.gateway, *self.replicas] if c is not None]

    def stop(self, timeout: float) -> None:
        """The gateway first, then the replicas, each with SIGTERM; SIGKILL past the timeout."""
        for group in ([self.gateway], self.replicas):
            live = [c for c in group if c is not None and c.proc.poll() is None]
            for c in live:
                c.proc.terminate()
            deadline = time.monotonic() + timeout
            for c in live:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("engine serve: %s did not stop in %.0f s: killed", c.name, timeout)
                    c.proc.kill()
                    c.proc.wait()

    def exited(self) -> Child | None:
        return next((c for c in self.children() if c.proc.poll() is not None), None)


def run(
    dp: int,
    engine_argv: Sequence[str],
    host: str,
    port: int,
    policy: str,
    gateway_args: Sequence[str],
    num_threads: int | None,
    shutdown_timeout: float,
    api_key: str | None,
    startup_timeout: float,
) -> int:
    """Start, serve until a signal or a death, stop. Returns the exit code (0 after a signal)."""
    from engine.cores import usable_cores

    try:
        gateway.smg_command()  # not installed: say so before starting any replica
    except FileNotFoundError as exc:
        log.error("engine serve: %s", exc)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threads = num_threads if num_threads is not None else max(1, usable_cores() // dp)
    env = dict(os.environ)
    if api_key:
        env["ENGINE_API_KEY"] = api_key  # not on the replicas' command lines, where ps shows it
    deployment = Deployment(
        [_spawn(f"replica {i}", replica_argv(engine_argv, threads), env) for i in range(dp)]
    )
    try:
        deadline = time.monotonic() + startup_timeout
        while not all(c.url for c in deployment.replicas):
            if stop.wait(0.2):
                return 0
            gone = deployment.exited()
            if gone is not None:
                log.error(
                    "engine serve: %s exited with code %s before it was ready; stopping",
                    gone.name,
                    gone.proc.returncode,
                )
                return 1
            if time.monotonic() > deadline:
                log.error("engine serve: replicas not ready in %.0f s; stopping", startup_timeout)
                return 1
        urls = [c.url for c in deployment.replicas]
        port = port or free_port(host)
        cmd = gateway.launch_command(
            urls, host, port, policy, free_port(host), api_key, gateway_args
        )
        deployment.gateway = _spawn("gateway", cmd)
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        probe = url.replace("0.0.0.0", "127.0.0.1").replace("[::]", "[::1]")

        def serving() -> bool:
            return deployment.gateway.proc.poll() is None and not stop.is_set()

        if not gateway.wait_routing(
            probe,
            urls,
            GATEWAY_START_TIMEOUT,
            api_key,
            alive=serving,
        ):
            if stop.is_set():
                return 0
            log.error("engine serve: the gateway did not route to every replica; stopping")
            return 1
        # cache-aware routing places a new prefix by the replicas' polled loads, a coin toss until
        # every replica has one (gateway.launch_command); the poll comes within a second
        if not gateway.wait_loads(
            probe,
            urls,
            LOADS_TIMEOUT,
            api_key,
            alive=serving,
        ):
            if stop.is_set():
                return 0
            log.warning("engine serve: the gateway has not polled every replica's load yet")
        print(
            f"engine serve: ready on {url} (smg gateway, policy {policy}; "
            f"{dp} replicas: {' '.join(urls)})",
            flush=True,
        )
        while not stop.wait(0.2):
            gone = deployment.exited()
            if gone is not None:
                log.error(
                    "engine serve: %s exited with code %s; stopping every replica",
                    gone.name,
                    gone.proc.returncode,
                )
                return 1
        log.warning("engine serve: stopping the gateway, then %d replicas", dp)
        return 0
    finally:
        deployment.stop(shutdown_timeout + 15)

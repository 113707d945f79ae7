"""Starting `engine serve` as a real subprocess on 127.0.0.1 for the server tests, and the plugin a
test server can load to hold or refuse marked requests (what no HTTP request can do by itself)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from engine.hooks import hookimpl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return "".join(self.lines)


READY = re.compile(r"engine serve: ready on http://127\.0\.0\.1:(\d+) ")


def start_server(*flags: str, env: dict | None = None, timeout: float = 240.0) -> Server:
    """engine serve on --port 0 with these flags; returns once it printed its ready line, which
    names the port the system chose (fails with its output otherwise)."""
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "ENGINE_API_KEY")
    }
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.serve", "--port", "0", "--dtype", "float32", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
    )
    server = Server(proc, 0)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            server.lines.append(line)
            found = READY.search(line)
            if found:
                server.port = int(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server not ready after {timeout}s:\n{server.output()}")
    if not server.port:
        proc.kill()
        raise AssertionError(
            f"no ready line naming a port (exit code {proc.poll()}):\n{server.output()}"
        )
    return server


def stop_server(server: Server, timeout: float = 60.0) -> int:
    if server.proc.poll() is None:
        server.proc.terminate()
    return server.proc.wait(timeout)


# ---------------------------------------------------------------------- the test server's plugin

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PLUGIN = "server_helpers:plugin"  # engine serve --plugins PLUGIN, with TESTS_DIR on PYTHONPATH
HOLD = "HOLD "  # a prompt "HOLD <path>\n...": tokenizing it waits for <path>.release, after making <path>.entered
HOLD_OUTPUT = "hold-output:"  # a request whose rid is "hold-output:<path>": its output hook waits as HOLD's tokenizing
UNSENT = "UNSENT"  # a prompt starting so is refused by engine_request_submitted: it is never sent


def _hold(path: str) -> None:
    """Wait for <path>.release, after making <path>.entered."""
    open(path + ".entered", "w").close()
    deadline = time.monotonic() + 60  # a test that died never holds a server for long
    while not os.path.exists(path + ".release") and time.monotonic() < deadline:
        time.sleep(0.01)


class _ServerTestPlugin:
    """Marked prompts only; every other request passes untouched."""

    @hookimpl
    def engine_tokenize_before(self, request) -> None:
        if isinstance(request.prompt, str) and request.prompt.startswith(HOLD):
            _hold(request.prompt[len(HOLD) :].split("\n", 1)[0])

    @hookimpl
    def engine_output(self, result) -> None:
        rid = result["meta_info"]["id"]
        if rid.startswith(HOLD_OUTPUT):
            _hold(rid[len(HOLD_OUTPUT) :])

    @hookimpl
    def engine_request_submitted(self, rid, request, sampling, trace_context) -> None:
        if isinstance(request.prompt, str) and request.prompt.startswith(UNSENT):
            raise RuntimeError("refused on purpose by the test plugin")


plugin = _ServerTestPlugin()

"""`engine serve --dp 2`: one command starts two replicas and the SGLang model gateway in front of
them; requests through it reach both; SIGTERM stops everything with exit code 0, and a replica that
dies stops everything with exit code 1; no process is left behind either way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from engine.serve import gateway
from engine.serve.cli import replica_flags
from helpers import wait_gone
from server_helpers import free_port

openai = pytest.importorskip("openai")

KEY = "scale-key-1"
READY = re.compile(r"engine serve: ready on (http://\S+) .*replicas: (.*)\)")


def _have_smg() -> bool:
    try:
        gateway.smg_command()
    except FileNotFoundError:
        return False
    return True


needs_smg = pytest.mark.skipif(
    not _have_smg(), reason="the SGLang model gateway is not installed (pip install smg==1.13.0)"
)


class Launch:
    """engine serve --dp 2 as a subprocess, until its ready line."""

    def __init__(self, model_dir: str, *flags: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "ENGINE_API_KEY")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.serve",
                "--dp",
                "2",
                "--policy",
                "round_robin",
                "--port",
                str(free_port()),
                "--model-path",
                model_dir,
                "--dtype",
                "float32",
                "--max-total-tokens",
                "2048",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        self.replicas: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(240) or not self.url:
            self.proc.kill()
            raise AssertionError("".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            found = READY.search(line)
            if found:
                self.url, self.replicas = found.group(1), found.group(2).split()
                self.ready.set()
        self.ready.set()

    def pids(self) -> list[int]:
        """Every process of the deployment: the launcher's whole tree."""
        root = psutil.Process(self.proc.pid)
        return [root.pid] + [p.pid for p in root.children(recursive=True)]

    def output(self) -> str:
        return "".join(self.lines)


def test_replica_flags_are_the_command_line_less_the_launchers_own():
    argv = ["--dp", "2", "--policy=round_robin", "--port", "8000", "--host", "0.0.0.0"]
    argv += ["--api-key", "k", "--gateway-arg=--retry-max-retries", "--gateway-arg", "3"]
    argv += ["--dtype", "float32", "--max-total-tokens", "2048", "--served-model-name", "m"]
    assert replica_flags(argv) == [
        "--dtype",
        "float32",
        "--max-total-tokens",
        "2048",
        "--served-model-name",
        "m",
    ]


@needs_smg
def test_dp_2_serves_through_the_gateway_and_stops_on_sigterm(tiny_llama_dir):
    """With --api-key the gateway asks clients for the key and the replicas ask the gateway."""
    launch = Launch(tiny_llama_dir, "--api-key", KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        pids = launch.pids()
        assert len(launch.replicas) == 2 and len(pids) >= 8  # launcher, gateway, 2 x 3 engine
        replicas = [p for p in pids[1:] if "engine.serve" in " ".join(psutil.Process(p).cmdline())]
        assert len(replicas) == 2  # the key reaches them through the environment, not ps
        assert all(KEY not in " ".join(psutil.Process(p).cmdline()) for p in replicas)
        name = httpx.get(launch.replicas[0] + "/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": name, "prompt": "Hi", "max_tokens": 2}
        for url in (launch.url, launch.replicas[0]):
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        client = openai.OpenAI(base_url=launch.url + "/v1", api_key=KEY, max_retries=0)
        for i in range(8):
            out = client.completions.create(model=name, prompt=f"Hello {i}", max_tokens=2)
            assert out.usage.completion_tokens == 2
        counts = [
            httpx.get(u + "/stats", headers=auth, timeout=30).json()["finished_requests"]
            for u in launch.replicas
        ]
        assert counts == [4, 4], counts
        launch.proc.send_signal(signal.SIGTERM)
        assert launch.proc.wait(90) == 0, launch.output()
        assert wait_gone(pids, 15) == []
    finally:
        if launch.proc.poll() is None:
            launch.proc.kill()


@needs_smg
def test_a_replica_that_dies_stops_the_deployment_with_exit_code_1(tiny_llama_dir):
    launch = Launch(tiny_llama_dir)
    try:
        pids = launch.pids()
        victim = httpx.get(launch.replicas[1] + "/server_info").json()["pids"]["user"]
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        assert launch.proc.wait(90) == 1, launch.output()
        assert time.monotonic() - started < 60
        assert "replica 1 exited" in launch.output()
        assert wait_gone(pids, 15) == []
    finally:
        if launch.proc.poll() is None:
            launch.proc.kill()

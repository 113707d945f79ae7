"""The SGLang model gateway (`smg`, a Rust router on PyPI) in front of `engine serve` workers: its
command line, and waiting until it routes to every worker (docs/scale-out.md).

The gateway is not part of the engine: it is installed beside it (`pip install smg==1.13.0`, in the
`test` extra) and run as its own process, with `smg launch --worker-urls ...`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "prefix_hash")
LOAD_MONITOR_INTERVAL = 1  # seconds between the gateway's polls of every worker's /v1/loads


def smg_command() -> list[str]:
    """How to run the gateway: the `smg` script beside this interpreter, else on PATH."""
    here = shutil.which("smg", path=os.path.dirname(sys.executable))
    found = here or shutil.which("smg")
    if found is None:
        raise FileNotFoundError(
            "the SGLang model gateway is not installed: pip install smg==1.13.0 (docs/scale-out.md)"
        )
    return [found]


def launch_command(
    worker_urls: Sequence[str],
    host: str,
    port: int,
    policy: str,
    prometheus_port: int,
    api_key: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`smg launch` for these workers. Health is probed every second and two failures mark a worker
    not ready, so a dead replica stops getting requests within about 2 s (the gateway's defaults,
    60 s and 3, suit slow probes of large fleets). Loads are polled every second, not every 10 s:
    the gateway's first poll runs as the first worker registers, so the others have no load on file
    until the next one, and while one worker has none cache-aware routing scores every request that
    matches no cached prefix as a tie between them and places it by a coin toss (docs/scale-out.md,
    Cache-aware routing); `wait_loads` waits for that poll. Its Prometheus listener is bound beside
    the gateway, on the gateway's host; the tokenizer is not loaded (HTTP routing reads text, not
    tokens). `extra` comes last, so it overrides any of these."""
    cmd = [
        *smg_command(),
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "2",
        "--health-success-threshold",
        "1",
        "--load-monitor-interval",
        str(LOAD_MONITOR_INTERVAL),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--disable-tokenizer-autoload",
        "--log-level",
        "warn",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra)


def get_json(url: str, timeout: float = 5.0, api_key: str | None = None):
    """GET a JSON answer (None when the server does not answer or answers an error)."""
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def workers(gateway_url: str, api_key: str | None = None) -> list[dict]:
    """The gateway's worker list (GET /workers): each with its id, url and status."""
    answer = get_json(gateway_url + "/workers", api_key=api_key)
    if not isinstance(answer, dict):
        return []
    return list(answer.get("workers") or [])


def is_ready(worker: dict) -> bool:
    """Whether the gateway routes to this worker now (its status field, or older releases' flag)."""
    status = worker.get("status")
    if status is not None:
        return str(status).lower() == "ready"
    return bool(worker.get("is_healthy"))


def wait_routing(
    gateway_url: str,
    worker_urls: Sequence[str],
    timeout: float,
    api_key: str | None = None,
    alive=lambda: True,
) -> bool:
    """Wait until the gateway lists every worker as ready; False at the deadline or once `alive()`
    says the gateway process is gone."""
    want = set(worker_urls)
    return _wait(
        lambda: want <= {w.get("url") for w in workers(gateway_url, api_key) if is_ready(w)},
        timeout,
        alive,
    )


def loads_on_file(gateway_url: str, api_key: str | None = None) -> set[str]:
    """The workers whose load the gateway has polled (GET /get_loads: its snapshot, not a new poll)."""
    answer = get_json(gateway_url + "/get_loads", api_key=api_key)
    if not isinstance(answer, dict):
        return set()
    return {entry.get("worker") for entry in answer.get("loads") or [] if isinstance(entry, dict)}


def wait_loads(
    gateway_url: str,
    worker_urls: Sequence[str],
    timeout: float,
    api_key: str | None = None,
    alive=lambda: True,
) -> bool:
    """Wait until the gateway holds a polled load for every worker, so that its load-aware choices
    (cache-aware routing's placement of a new prefix) compare like with like; False at the deadline
    or once `alive()` says the gateway process is gone."""
    want = set(worker_urls)
    return _wait(lambda: want <= loads_on_file(gateway_url, api_key), timeout, alive)


def _wait(done, timeout: float, alive) -> bool:
    """Poll `done()` every 0.2 s: True once it holds, False at the deadline or once `alive()` fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if done():
            return True
        time.sleep(0.2)
    return False

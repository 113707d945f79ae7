"""Tracing faults: an OTLP endpoint that accepts connections and never answers, and a trace file on a
full disk (/dev/full: every write fails with ENOSPC). Requests are served at their usual pace, the
script ends, every process is gone. Each engine runs in its own interpreter (the tracing plugin is
process-wide state)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from helpers import wait_gone

SCRIPT = """
import json, sys, time
from engine import Engine
if __name__ == "__main__":
    t0 = time.monotonic()
    with Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=1024) as eng:
        pids = eng.pids
        t1 = time.monotonic()
        greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        outs = [eng.generate("Hello there", greedy) for _ in range(5)]
        t2 = time.monotonic()
    print("RESULT " + json.dumps({"pids": pids, "start_s": t1 - t0, "generate_s": t2 - t1,
                                  "shutdown_s": time.monotonic() - t2,
                                  "tokens": [len(o["output_ids"]) for o in outs]}), flush=True)
"""


def run_traced(tmp_path, tiny_llama_dir, env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "traced.py"
    script.write_text(SCRIPT)
    full = dict(os.environ, ENGINE_TRACING="1", OTEL_BSP_SCHEDULE_DELAY="200", **env)
    run = subprocess.run(
        [sys.executable, str(script), tiny_llama_dir],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(
        next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:]
    )
    assert result["tokens"] == [8] * 5
    assert not wait_gone(result["pids"].values(), 10), "a process was left behind"
    return run, result


def test_an_otlp_endpoint_that_hangs_does_not_hold_up_requests_or_shutdown(
    tmp_path, tiny_llama_dir
):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_hang() -> None:  # takes each connection, reads nothing, answers nothing
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_hang, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        run, result = run_traced(
            tmp_path,
            tiny_llama_dir,
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{listener.getsockname()[1]}",
                "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
            },
        )
        took = time.monotonic() - start
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
    assert held, "the exporter never connected: the fault was not injected"
    assert result["generate_s"] < 20, result  # 5 short requests: the export is off the request path
    assert took < 180, (took, result)  # the exporters give up at their timeout; shutdown is bounded


def test_a_trace_file_on_a_full_disk_does_not_stop_serving(tmp_path, tiny_llama_dir):
    if not os.path.exists("/dev/full"):
        import pytest

        pytest.skip("no /dev/full on this system")
    run, result = run_traced(tmp_path, tiny_llama_dir, {"ENGINE_TRACE_FILE": "/dev/full"})
    assert result["generate_s"] < 20, result
    assert (
        "ENGINE_TRACE_FILE='/dev/full' cannot be written" in run.stderr
        and "No space left" in run.stderr
    ), run.stderr[-2000:]

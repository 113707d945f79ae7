"""`engine serve`'s life: a start failure, one trace from the client's span through the HTTP span
into all three processes (a real OTLP receiver), SIGTERM during a stream (exit 0, no process
left, traces flushed), a dead engine child (the stream fails clearly, exit 1), and 503s from a
stopped engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers import wait_gone, wait_path
from server_helpers import HOLD, PLUGIN, TESTS_DIR, start_server, stop_server


def test_a_start_failure_exits_non_zero_with_the_reason():
    proc = subprocess.run(
        [sys.executable, "-m", "engine.serve", "--dtype", "float64", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "did not start" in proc.stderr and "dtype must be one of" in proc.stderr


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    from engine.tracing.receiver import OTLPReceiver

    with OTLPReceiver(out_path=str(tmp_path_factory.mktemp("spans") / "spans.jsonl")) as rx:
        yield rx


@pytest.fixture(scope="module")
def traced_server(receiver):
    env = {
        "ENGINE_TRACING": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "PYTHONPATH": TESTS_DIR,
    }
    srv = start_server(
        "--max-total-tokens", "4096", "--shutdown-timeout", "2", "--plugins", PLUGIN, env=env
    )
    yield srv
    if srv.proc.poll() is None:
        stop_server(srv)


def test_a_client_traceparent_gives_one_trace_through_http_and_all_three_processes(
    traced_server, receiver
):
    from openai import OpenAI

    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client = OpenAI(base_url=traced_server.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
    )

    def complete(
        spans,
    ) -> bool:  # the HTTP server span and the request's root end last: wait for them too
        mine = [s for s in spans if s.trace_id == trace_id]
        return (
            {"user", "scheduler", "detokenizer"} <= {s.role for s in mine}
            and {"tokenize", "queue", "prefill", "decode", "detokenize"} <= {s.name for s in mine}
            and any(s.parent_span_id == client_span for s in mine)
            and any("gen_ai.operation.name" in s.attributes for s in mine)
        )

    assert receiver.wait_for(complete, 30), "the request's spans did not all arrive"
    spans = [s for s in receiver.spans() if s.trace_id == trace_id]
    http = [s for s in spans if s.parent_span_id == client_span]
    assert len(http) == 1, [(s.name, s.parent_span_id) for s in spans]
    server_span = http[0]
    assert server_span.name.startswith("POST") and "/v1/chat/completions" in server_span.name
    method = server_span.attributes.get(
        "http.request.method", server_span.attributes.get("http.method")
    )
    # OpenTelemetry's HTTP semantic conventions, from its ASGI instrumentation
    assert method == "POST"
    root = next(s for s in spans if "gen_ai.operation.name" in s.attributes)
    assert (
        root.parent_span_id == server_span.span_id
        and root.attributes["engine.request_id"] == out.id
    )
    names = {s.name for s in spans}
    assert {"tokenize", "queue", "prefill", "decode", "detokenize"} <= names


def test_max_tokens_left_out_is_what_the_context_and_the_pool_leave(traced_server, receiver):
    """OpenAI's chat default (vLLM's, SGLang's): the context length less the prompt, not the engine's 128;
    here the pool (4096 tokens) is smaller than the context (8192), so what the pool leaves. The
    request's span says the max_tokens the engine got; a regex ends the answer in a few tokens.
    (Completions default to 16: tests/test_server.py.)"""
    body = {
        "messages": [{"role": "user", "content": "My lucky number is"}],
        "regex": "[0-9]{2}",
        "temperature": 0,
    }
    out = httpx.post(traced_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    info = httpx.get(traced_server.url + "/server_info", timeout=30).json()
    assert info["max_total_tokens"] < info["context_length"]
    # the last token's KV is never stored
    want = info["max_total_tokens"] + 1 - out["usage"]["prompt_tokens"]

    def root(spans) -> list:
        return [
            s
            for s in spans
            if s.attributes.get("engine.request_id") == out["id"]
            and "gen_ai.operation.name" in s.attributes
        ]

    assert receiver.wait_for(lambda spans: bool(root(spans)), 30)
    assert root(receiver.spans())[0].attributes["gen_ai.request.max_tokens"] == want


def test_sigterm_during_a_stream_exits_0_and_leaves_no_process(traced_server, receiver, tmp_path):
    """Past --shutdown-timeout the server aborts what runs, and also what was still being tokenized
    then (the test plugin holds one request's tokenizing until after the stream's abort)."""
    pids = httpx.get(traced_server.url + "/server_info", timeout=30).json()["pids"]
    events: list[str] = []
    started = threading.Event()
    holds = [str(tmp_path / "held"), str(tmp_path / "held-stream")]
    late: list[dict] = [{}, {}]

    def held(i: int) -> None:  # the second streams
        body = {
            "prompt": f"{HOLD}{holds[i]}\nTell me a story.",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": i == 1,
        }
        try:
            with httpx.stream(
                "POST", traced_server.url + "/v1/completions", json=body, timeout=120
            ) as r:
                late[i]["status"], late[i]["body"] = r.status_code, r.read().decode()
        except httpx.HTTPError as exc:
            late[i]["error"] = exc

    senders = [threading.Thread(target=held, args=(i,)) for i in range(2)]
    for sender in senders:
        sender.start()

    def stream() -> None:
        body = {
            "prompt": "Tell me a long story.",
            "max_tokens": 3000,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream(
            "POST", traced_server.url + "/v1/completions", json=body, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60) and all(wait_path(h + ".entered", 60) for h in holds)
    traced_server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert events[-1] == "[DONE]"  # ended in order: past --shutdown-timeout the request was aborted
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    # tokenized only now, after the abort, one after the other: aborted once sent
    for h, sender in zip(holds, senders):
        open(h + ".release", "w").close()
        sender.join(30)
        time.sleep(1)  # the stream comes when nothing else runs
    assert traced_server.proc.wait(60) == 0, traced_server.output()
    assert all(r.get("status") == 200 for r in late), late
    assert json.loads(late[0]["body"])["choices"][0]["finish_reason"] == "abort"
    data = [line[6:] for line in late[1]["body"].splitlines() if line.startswith("data: ")]
    assert (
        data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
    ), data[-3:]
    assert wait_gone(list(pids.values()), 10) == []
    # the stream's spans were flushed at the stop
    assert receiver.wait_for(
        lambda spans: any(s.role == "user" and s.status_code == 2 for s in spans), 10
    )


def test_a_dead_engine_child_fails_the_stream_and_exits_1():
    srv = start_server("--max-total-tokens", "4096")
    try:
        pids = httpx.get(srv.url + "/server_info", timeout=30).json()["pids"]
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {
                "prompt": "Count to a thousand:",
                "max_tokens": 3000,
                "stream": True,
                "ignore_eos": True,
            }
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            started.set()
            except httpx.HTTPError:
                events.append("connection closed")

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        os.kill(pids["scheduler"], signal.SIGKILL)
        assert srv.proc.wait(60) == 1, srv.output()
        reader.join(30)
        assert "an engine process died" in srv.output()
        errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
        assert errors and "scheduler" in errors[0]["message"], events[-3:]
        assert events[-1] == "[DONE]"
        assert wait_gone(list(pids.values()), 10) == []
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_a_stopped_engine_answers_503(tiny_llama_dir):
    from starlette.testclient import TestClient

    from engine import Engine
    from engine.serve.app import ServeOptions, build_app

    eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024)
    app = build_app(eng, ServeOptions("tiny"))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        eng.shutdown()
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


METRICS_SCRIPT = """
import sys, urllib.request, urllib.error
from engine import Engine

if __name__ == "__main__":
    port = sys.argv[2]
    with Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=1024, plugins="metrics") as eng:
        eng.generate("Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        print("METRICS " + urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode())
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        print("STILL OPEN")
    except (urllib.error.URLError, OSError):
        print("CLOSED")
"""


def test_an_offline_engine_serves_metrics_at_engine_metrics_port(tiny_llama_dir, tmp_path):
    """In a script of its own: the port closes with the last engine of the process."""
    from prometheus_client.parser import text_string_to_metric_families

    from server_helpers import free_port

    port = free_port()
    (tmp_path / "script.py").write_text(METRICS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_PLUGINS"}
    env["ENGINE_METRICS_PORT"] = str(port)
    proc = subprocess.run(
        [sys.executable, "script.py", tiny_llama_dir, str(port)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout.split("METRICS ", 1)[1].rsplit("\n", 2)[0]
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["engine:generation_tokens_total"] == 3
    # from the scheduler, via engine_stats
    assert samples["engine:request_queue_time_seconds_count"] == 1
    assert proc.stdout.strip().endswith("CLOSED")


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--port", "70000"),
        ("--port", "-1"),
        ("--shutdown-timeout", "nan"),
        ("--shutdown-timeout", "-5"),
        ("--max-request-bytes", "0"),
    ],
)
def test_server_flags_out_of_range_are_refused_before_the_engine_starts(flag, value, capsys):
    """`--port 70000` passed argparse, the engine loaded, then asyncio's bind raised OverflowError: a
    traceback, not the documented exit; `--shutdown-timeout nan` (or a negative one) drained nothing,
    `--max-request-bytes 0` made every request a 413. argparse refuses them now, naming the flag (exit 2)."""
    from engine.serve.cli import parser

    with pytest.raises(SystemExit) as exc:
        parser().parse_args([flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_serve_flags_build_a_valid_engine_config():
    """Every EngineConfig field's flag default is a valid value (a dict field's default once arrived as
    dataclasses.MISSING and every `engine serve` failed to start); `--kernel-overrides` parses rows."""
    import dataclasses

    from engine.config import EngineConfig
    from engine.serve.cli import parser

    args = parser().parse_args([])
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    assert EngineConfig(**options).kernel_overrides == {}  # constructs: every default is valid
    args = parser().parse_args(["--kernel-overrides", "fused-decode=off,native-extend=off"])
    assert args.kernel_overrides == {"fused-decode": "off", "native-extend": "off"}


def test_serve_kernel_overrides_flag_malformed_is_refused(capsys):
    from engine.serve.cli import parser

    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--kernel-overrides", "fused-decode"])
    assert exc.value.code == 2
    assert "--kernel-overrides" in capsys.readouterr().err

"""OpenTelemetry tracing end to end: a real OTLP receiver on 127.0.0.1 (gRPC and HTTP, the services of
opentelemetry-proto), a real engine with ENGINE_TRACING=1 exporting to it over the network.

Checked: one trace per request with spans from all three processes (by their resource), parents across
the hops, true order in time, links from every step span to the requests it served, the GenAI
attributes equal to meta_info, errors on spans, a caller's traceparent (or current span) as parent,
OTLP over HTTP, the file exporter, and every span delivered when a script ends without shutdown.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from engine.hooks import hookimpl
from engine.tracing.otlp_json import SpanRecord, read_spans
from engine.tracing.receiver import OTLPReceiver

ROLES = {"user", "scheduler", "detokenizer"}
PROMPTS = ["The capital of France is", "Write one word about the sea:", "1, 2, 3,"]
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
SPAN_WAIT = 60.0


def test_otlp_json_lines_round_trip_and_http_json_body():
    """SDK spans -> an OTLP/JSON line (the file format) -> records; the same line POSTed as an OTLP/JSON
    body to the receiver's HTTP endpoint arrives with the same ids (hex in JSON, bytes on the wire)."""
    import urllib.request

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.tracing.otlp_json import records_from_lines, spans_to_line

    memory = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"engine.process.role": "user", "process.pid": 7})
    )
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span(
        "parent", attributes={"n": 3, "f": 0.5, "s": "x", "l": ["a", "b"]}
    ) as parent:
        with tracer.start_as_current_span("child", links=[]):
            pass
    line = spans_to_line(memory.get_finished_spans())
    records = {r.name: r for r in records_from_lines([line])}
    ctx = parent.get_span_context()
    assert (
        records["parent"].trace_id == f"{ctx.trace_id:032x}"
        and records["parent"].span_id == f"{ctx.span_id:016x}"
    )
    assert records["child"].parent_span_id == records["parent"].span_id
    assert records["parent"].attributes == {"n": 3, "f": 0.5, "s": "x", "l": ["a", "b"]}
    assert records["parent"].role == "user" and records["parent"].pid == 7
    assert (
        records["parent"].start_ns
        < records["child"].start_ns
        <= records["child"].end_ns
        < records["parent"].end_ns
    )
    with OTLPReceiver() as rx:
        post = urllib.request.Request(
            rx.http_endpoint + "/v1/traces",
            data=line.encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(post, timeout=10) as reply:
            assert reply.status == 200
            # OTLP/HTTP: the response is encoded as the request was (before: a protobuf body for JSON)
            assert reply.headers["Content-Type"] == "application/json"
            assert json.loads(reply.read()) == {}  # an ExportTraceServiceResponse, nothing rejected
        received = {r.name: r for r in rx.spans()}
    assert {n: (r.trace_id, r.span_id, r.parent_span_id) for n, r in received.items()} == {
        n: (r.trace_id, r.span_id, r.parent_span_id) for n, r in records.items()
    }


def test_the_receiver_reads_chunked_bodies_and_refuses_bodies_without_a_length():
    """A POST sent chunked (no Content-Length) was read as an empty body and answered 200: its spans
    dropped without a word; a malformed Content-Length raised in the handler and the client got no
    answer at all. Chunked bodies are read; a body with neither length is a 411, a bad length or chunk size
    a 400.
    And `engine trace receive` (keep=False) keeps no message in memory, only their counts."""
    import http.client
    from urllib.parse import urlparse

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.tracing.otlp_json import spans_to_line

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("t").start_span("chunked").end()
    body = spans_to_line(memory.get_finished_spans()).encode()

    def post(
        rx, headers: dict, chunks: list[bytes] | None = None, data: bytes | None = None
    ) -> int:
        url = urlparse(rx.http_endpoint)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        conn.putrequest("POST", "/v1/traces")
        for k, v in {"Content-Type": "application/json", **headers}.items():
            conn.putheader(k, v)
        conn.endheaders()
        for chunk in chunks or []:
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        if chunks is not None:
            conn.send(b"0\r\n\r\n")
        if data is not None:
            conn.send(data)
        status = conn.getresponse().status
        conn.close()
        return status

    with OTLPReceiver() as rx:
        assert post(rx, {"Transfer-Encoding": "chunked"}, chunks=[body[:20], body[20:]]) == 200
        assert [r.name for r in rx.spans()] == ["chunked"]
        assert post(rx, {}, data=b"") == 411
        assert post(rx, {"Content-Length": "ten"}, data=b"") == 400
        # a chunk size not in hex
        assert post(rx, {"Transfer-Encoding": "chunked"}, data=b"zz\r\n{}\r\n0\r\n\r\n") == 400
    with OTLPReceiver(keep=False) as rx:
        assert post(rx, {"Content-Length": str(len(body))}, data=body) == 200
        assert rx.export_count == 1 and rx.span_count == 1 and rx.requests == []


def test_receive_on_a_port_in_use_is_one_line_naming_it(capsys):
    """gRPC raises RuntimeError for a port in use (Jaeger holding 4317): `engine trace receive` printed a
    traceback instead of its one-line error."""
    import socket

    from engine.tracing.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["receive", "--grpc-port", str(port), "--http-port", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        f"engine trace receive: cannot listen for OTLP/gRPC on 127.0.0.1:{port}" in err
        and "Traceback" not in err
    )


def test_trace_steps_keeps_one_step_in_n_and_every_failed_step(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.hooks.types import StepRecord
    from engine.tracing.plugin import TracingPlugin
    from engine.tracing.setup import step_sampling

    monkeypatch.setenv("ENGINE_TRACE_STEPS", "3")
    assert step_sampling() == 3
    monkeypatch.setenv("ENGINE_TRACE_STEPS", "some")
    with pytest.raises(ValueError, match="ENGINE_TRACE_STEPS='some'"):
        step_sampling()
    memory = InMemorySpanExporter()
    plugin = TracingPlugin()
    plugin.provider = TracerProvider()
    plugin.provider.add_span_processor(SimpleSpanProcessor(memory))
    plugin.tracer, plugin.step_every = plugin.provider.get_tracer("t"), 3
    ok = StepRecord("decode", [], 0, 1, 2, 3, 4, 5)
    failed = StepRecord("decode", [], 0, 1, 2, None, None, 5, error="RuntimeError: boom")
    for record in [ok] * 7 + [failed]:
        plugin.engine_step_end(step=record)
    steps = [s for s in memory.get_finished_spans() if s.name == "decode step"]
    assert len(steps) == 2 + 1  # steps 3 and 6, and the failed one
    assert steps[-1].status.status_code.name == "ERROR" and "boom" in steps[-1].status.description
    assert [
        s.name
        for s in memory.get_finished_spans()
        if s.parent and s.parent.span_id == steps[-1].context.span_id
    ] == ["schedule", "forward"]  # the failed step: forward raised, no sample
    plugin.step_every = 0  # no step traces, but still every failed one
    memory.clear()
    plugin.engine_step_end(step=ok)
    assert memory.get_finished_spans() == ()
    plugin.engine_step_end(step=failed)
    assert [s.name for s in memory.get_finished_spans() if s.name.endswith(" step")] == [
        "decode step"
    ]


def test_no_step_spans_after_the_stop_hook_flushed():
    """A child's serving thread can end a step while its stop hook flushes, and the process then exits:
    that step's spans would reach one exporter and not another (CI saw the file exporter get five
    spans the collector never did). The stop hook is the last word: nothing is traced after it."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.hooks.types import StepRecord
    from engine.tracing.plugin import TracingPlugin

    memory = InMemorySpanExporter()
    plugin = TracingPlugin()
    plugin.provider = TracerProvider()
    plugin.provider.add_span_processor(SimpleSpanProcessor(memory))
    plugin.tracer, plugin.role = plugin.provider.get_tracer("t"), "scheduler"
    step = StepRecord("decode", [], 0, 1, 2, 3, 4, 5)
    plugin.engine_step_end(step=step)
    assert len(memory.get_finished_spans()) == 5  # the step and its four stages
    plugin.engine_process_stop(role="scheduler", pid=os.getpid())
    memory.clear()
    plugin.engine_step_end(step=step)
    assert memory.get_finished_spans() == ()


def test_a_flush_where_no_thread_can_start_flushes_in_the_calling_thread(monkeypatch):
    """The flush bounds force_flush in a thread of its own; Python 3.12 refuses new threads at
    interpreter shutdown, where the user process's last flush (atexit, an engine's close) runs, so its
    spans of the last seconds, a short script's roots, were never exported: RuntimeError, nothing sent.
    Where no thread can start, the flush runs in the calling thread."""
    import threading

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.tracing.plugin import TracingPlugin

    memory = InMemorySpanExporter()
    plugin = TracingPlugin()
    plugin.provider = TracerProvider()
    plugin.provider.add_span_processor(BatchSpanProcessor(memory, schedule_delay_millis=60_000))
    plugin.provider.get_tracer("t").start_span("root").end()

    def refused(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    plugin.flush()
    monkeypatch.undo()
    assert [s.name for s in memory.get_finished_spans()] == ["root"]
    plugin.provider.shutdown()


@pytest.mark.parametrize("hook", ["engine_request_finished", "engine_detokenize_output"])
def test_spans_a_hook_is_making_when_the_stop_hook_runs_are_in_its_flush(hook):
    """The same race for a request's own spans: the hook takes the request off the live list, then makes
    its spans; a stop hook running in between neither made them (the request was gone) nor flushed them
    (not made yet), so they reached one exporter and not another. The hook makes them under the lock."""
    import types

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.tracing.plugin import TracingPlugin

    memory = InMemorySpanExporter()
    plugin = TracingPlugin()
    plugin.provider = TracerProvider()
    plugin.provider.add_span_processor(SimpleSpanProcessor(memory))
    plugin.tracer = plugin.provider.get_tracer("t")
    inside, go, at_flush = threading.Event(), threading.Event(), []

    def make_spans(*args, **kwargs):  # stands in for the hook's own spans
        inside.set()
        go.wait(10)
        plugin.tracer.start_span("the request's").end()

    plugin._request_spans = plugin._detokenize_span = make_spans
    plugin.flush = lambda: at_flush.append(len(memory.get_finished_spans()))
    req = types.SimpleNamespace(rid="r", finished=None)
    if hook == "engine_request_finished":
        plugin.role = "scheduler"
        plugin.engine_request_arrived(req=req)
        call = lambda: plugin.engine_request_finished(req=req, finish_reason={"type": "length"})  # noqa: E731
    else:
        plugin.role = "detokenizer"
        plugin.detok["r"] = (1, {}, "r")
        out = types.SimpleNamespace(rids=["r"], headers=None, finished=[object()], meta=[None])
        call = lambda: plugin.engine_detokenize_output(output=out)  # noqa: E731
    worker = threading.Thread(target=call)
    worker.start()
    assert inside.wait(10)
    stopper = threading.Thread(
        target=plugin.engine_process_stop, kwargs={"role": plugin.role, "pid": os.getpid()}
    )
    stopper.start()
    stopper.join(0.3)  # in the race, the stop hook flushes now, before the spans exist
    go.set()
    worker.join(10)
    stopper.join(10)
    assert at_flush == [1]  # the flush came after the hook's spans


# first: these load and unload the plugin themselves, before the module's traced engine exists
@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported",
        ),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin' is not supported"),
        ({"ENGINE_TRACE_FILE": "/no/such/folder/spans.jsonl"}, "does not exist"),
    ],
)
def test_bad_tracing_settings_stop_the_engine_with_a_clear_error(monkeypatch, env, message):
    from engine import Engine
    from engine.errors import EngineStartError
    from engine.hooks import HookError
    from engine.hooks.loader import unload_plugins

    monkeypatch.setenv("ENGINE_TRACING", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        # HookError from the user process; EngineStartError if it was configured before (a child fails)
        with pytest.raises(
            (HookError, EngineStartError), match="tracing.*engine_process_start"
        ) as info:
            Engine(dtype="float32", max_total_tokens=2048)
        assert message in str(info.value)
    finally:
        unload_plugins(["tracing"])


def test_tracing_switch_values(monkeypatch):
    from engine.tracing.switch import tracing_enabled

    for value, on in (("1", True), (" 1 ", True), ("0", False), ("", False)):
        monkeypatch.setenv("ENGINE_TRACING", value)
        assert tracing_enabled() is on
    monkeypatch.delenv("ENGINE_TRACING")
    assert tracing_enabled() is False
    # docs/tracing.md: only 1 and 0
    for value in (
        "maybe",
        "yes",
        "true",
        "on",
        "off",
        "no",
        "false",
        "2",
    ):
        monkeypatch.setenv("ENGINE_TRACING", value)
        with pytest.raises(ValueError, match=f"ENGINE_TRACING='{value}'"):
            tracing_enabled()


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    out = tmp_path_factory.mktemp("spans") / "received.jsonl"
    with OTLPReceiver(out_path=str(out)) as rx:
        yield rx


def _traced_engine(endpoint: str, **options):
    """An engine whose processes export over OTLP/gRPC to endpoint: the children take the
    variables at spawn; then they go."""
    from engine import Engine

    env = {
        "ENGINE_TRACING": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "engine-test",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        return Engine(dtype="float32", max_total_tokens=4096, **options)


@pytest.fixture(scope="module")
def traced(receiver):
    """An engine whose three processes export over OTLP/gRPC to the receiver."""
    from engine.hooks.loader import loaded_plugins, unload_plugins

    assert "tracing" not in loaded_plugins()
    eng = _traced_engine(receiver.grpc_endpoint)
    yield eng
    eng.shutdown()
    from engine.hooks.loader import _loaded

    plugin = _loaded.get("tracing")
    unload_plugins(["tracing"])  # the rest of the session runs untraced
    if plugin is not None and plugin.provider is not None:
        plugin.provider.shutdown()


def _root(spans: list[SpanRecord], rid: str) -> SpanRecord:
    found = [
        s
        for s in spans
        if s.role == "user"
        and "gen_ai.operation.name" in s.attributes
        and s.attributes.get("engine.request_id") == rid
    ]
    assert len(found) == 1, f"{len(found)} root spans for {rid}"
    return found[0]


def _request_spans(spans: list[SpanRecord], rid: str) -> dict[str, SpanRecord]:
    """The request's spans by name (root under "root"), all in the root's trace."""
    root = _root(spans, rid)
    mine = [s for s in spans if s.attributes.get("engine.request_id") == rid and s is not root]
    out = {"root": root}
    for s in mine:
        assert s.name not in out, f"two {s.name} spans for {rid}"
        out[s.name] = s
    return out


def _complete(rids: list[str], names: set[str]):
    def check(spans: list[SpanRecord]) -> bool:
        for rid in rids:
            have = {s.name for s in spans if s.attributes.get("engine.request_id") == rid}
            if not names <= have or not any(
                "gen_ai.operation.name" in s.attributes
                and s.attributes.get("engine.request_id") == rid
                for s in spans
            ):
                return False
        return True

    return check


STAGES = {"tokenize", "queue", "prefill", "decode", "detokenize"}


@pytest.fixture(scope="module")
def batch(traced, receiver):
    """Three greedy requests in one call; their spans once all have arrived."""
    params = [
        {"max_new_tokens": n, "temperature": 0, "top_p": 0.9, "ignore_eos": True} for n in (6, 9, 4)
    ]
    results = traced.generate(PROMPTS, params)
    rids = [r["meta_info"]["id"] for r in results]
    assert receiver.wait_for(_complete(rids, STAGES), SPAN_WAIT), "spans did not all arrive"
    # a request's spans end inside its last step, whose span ends after them and can come in a later export
    tokens = {r["meta_info"]["id"]: r["meta_info"]["completion_tokens"] for r in results}
    assert receiver.wait_for(_steps_served(tokens), SPAN_WAIT), "step spans did not all arrive"
    return results, receiver.spans()


def _steps_served(tokens: dict[str, int]):
    """True once the step spans name each request as often as it has tokens (a prefill, then decodes)."""

    def check(spans: list[SpanRecord]) -> bool:
        served = dict.fromkeys(tokens, 0)
        for s in spans:
            if "engine.step.mode" in s.attributes and not s.parent_span_id:
                for rid in s.attributes["engine.request_ids"]:
                    if rid in served:
                        served[rid] += 1
        return served == tokens

    return check


def test_one_trace_per_request_with_spans_from_all_three_processes(traced, batch):
    results, spans = batch
    pids = traced.pids
    traces = set()
    for r in results:
        rid = r["meta_info"]["id"]
        found = _request_spans(spans, rid)
        assert set(found) == STAGES | {"root"}
        trace_ids = {s.trace_id for s in found.values()}
        assert len(trace_ids) == 1, trace_ids
        traces |= trace_ids
        by_role = {s.role for s in found.values()}
        assert by_role == ROLES
        for s in found.values():
            assert s.pid == pids[s.role], (s.name, s.resource)
            assert s.resource["service.name"] == "engine-test"
        root = found["root"]
        assert root.parent_span_id == ""  # no caller context: the engine's span is the root
        assert found["tokenize"].role == "user"
        assert found["queue"].role == found["prefill"].role == found["decode"].role == "scheduler"
        assert found["detokenize"].role == "detokenizer"
        for name in STAGES:  # each stage is a child of the root, across the process hops
            assert found[name].parent_span_id == root.span_id, name
    assert len(traces) == len(results)


def test_every_ranks_scheduler_spans_are_in_the_requests_trace(traced, receiver, tmp_path):
    """Under tp_size=2 both ranks' schedulers export a request's spans into its one trace, each
    process marked by its rank (engine.tp.rank). The children export to a receiver of their own
    (the module's keeps one engine's processes); the root comes from this process's exporter."""
    with OTLPReceiver(out_path=str(tmp_path / "ranks.jsonl")) as ranks_rx:
        with _traced_engine(ranks_rx.grpc_endpoint, tp_size=2) as eng:
            out = eng.generate(PROMPTS[0], {"max_new_tokens": 3, "temperature": 0})
            rid = out["meta_info"]["id"]

            def mine(spans: list[SpanRecord], name: str) -> list[SpanRecord]:
                return [
                    s
                    for s in spans
                    if s.attributes.get("engine.request_id") == rid and s.name == name
                ]

            def arrived(spans: list[SpanRecord]) -> bool:
                return all(len(mine(spans, n)) == 2 for n in ("queue", "prefill", "decode"))

            assert receiver.wait_for(
                lambda spans: any(
                    "gen_ai.operation.name" in s.attributes
                    and s.attributes.get("engine.request_id") == rid
                    for s in spans
                ),
                SPAN_WAIT,
            ), "the root span did not arrive"
            assert ranks_rx.wait_for(arrived, SPAN_WAIT), "the ranks' spans did not arrive"
            root = _root(receiver.spans(), rid)
            spans = ranks_rx.spans()
            for name in ("queue", "prefill", "decode"):
                by_rank = {s.resource.get("engine.tp.rank"): s for s in mine(spans, name)}
                assert set(by_rank) == {"0", "1"}, name
                assert by_rank["0"].pid == eng.pids["scheduler"]
                assert by_rank["1"].pid == eng.pids["scheduler rank 1"]
                for s in by_rank.values():
                    assert (s.trace_id, s.parent_span_id) == (root.trace_id, root.span_id)


def test_spans_are_in_true_order_and_nested_in_time(batch):
    results, spans = batch
    for r in results:
        s = _request_spans(spans, r["meta_info"]["id"])
        root = s["root"]
        for name in STAGES:
            assert root.start_ns <= s[name].start_ns <= s[name].end_ns <= root.end_ns, name
        assert s["tokenize"].end_ns <= s["queue"].start_ns  # sent after tokenizing
        (received,) = [e for e in s["queue"].events if e["name"] == "received by the scheduler"]
        assert s["queue"].start_ns <= received["time_ns"] <= s["queue"].end_ns
        assert s["queue"].end_ns == s["prefill"].start_ns  # admitted
        assert s["prefill"].end_ns == s["decode"].start_ns  # first token
        assert s["prefill"].start_ns <= s["detokenize"].start_ns  # first output after the prefill
        # the last output leaves the scheduler first
        assert s["decode"].end_ns <= s["detokenize"].end_ns


def test_genai_attributes_equal_meta_info(traced, batch):
    results, spans = batch
    for r, max_new in zip(results, (6, 9, 4)):
        meta = r["meta_info"]
        s = _request_spans(spans, meta["id"])
        a = s["root"].attributes
        assert s["root"].name == f"text_completion {traced.server_info['model']}"
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == traced.server_info["model"] == "SmolLM2-135M-Instruct"
        assert a["gen_ai.request.max_tokens"] == max_new
        assert a["gen_ai.request.temperature"] == 0.0
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert a["gen_ai.usage.input_tokens"] == meta["prompt_tokens"]
        assert (
            a["gen_ai.usage.output_tokens"]
            == meta["completion_tokens"]
            == len(r["output_ids"])
            == max_new
        )
        assert a["gen_ai.response.finish_reasons"] == [meta["finish_reason"]["type"]] == ["length"]
        assert a["engine.cached_tokens"] == meta["cached_tokens"]
        assert a["engine.request_id"] == a["gen_ai.response.id"] == meta["id"]
        assert s["root"].status_code != 2
        assert s["tokenize"].attributes["gen_ai.usage.input_tokens"] == meta["prompt_tokens"]
        assert s["prefill"].attributes["gen_ai.usage.input_tokens"] == meta["prompt_tokens"]
        assert s["prefill"].attributes["engine.cached_tokens"] == meta["cached_tokens"]
        assert s["decode"].attributes["gen_ai.usage.output_tokens"] == meta["completion_tokens"]
        assert s["decode"].attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert s["detokenize"].attributes["gen_ai.usage.output_tokens"] == meta["completion_tokens"]


def test_step_spans_link_to_every_request_they_served(traced, batch):
    results, spans = batch
    roots = {r["meta_info"]["id"]: _root(spans, r["meta_info"]["id"]) for r in results}
    steps = [s for s in spans if "engine.step.mode" in s.attributes and not s.parent_span_id]
    assert steps and all(s.role == "scheduler" and s.pid == traced.pids["scheduler"] for s in steps)
    served: dict[str, dict[str, int]] = {rid: {"prefill": 0, "decode": 0} for rid in roots}
    all_roots = {
        (s.trace_id, s.span_id): s.attributes["engine.request_id"]
        for s in spans
        if s.role == "user" and "gen_ai.operation.name" in s.attributes
    }
    for step in steps:
        links = step.links
        assert len(links) == step.attributes["engine.batch_size"]
        assert step.name == f"{step.attributes['engine.step.mode']} step"
        # each link: a request's root
        linked = [all_roots.get((ln["trace_id"], ln["span_id"])) for ln in links]
        assert linked == list(step.attributes["engine.request_ids"])
        for rid in linked:
            if rid in roots:
                served[rid][step.attributes["engine.step.mode"]] += 1
        children = [
            s for s in spans if s.trace_id == step.trace_id and s.parent_span_id == step.span_id
        ]
        assert [c.name for c in sorted(children, key=lambda c: c.start_ns)] == [
            "schedule",
            "forward",
            "sample",
            "process_results",
        ]
        for c in children:
            assert step.start_ns <= c.start_ns <= c.end_ns <= step.end_ns
            # the batch spans carry the links
            assert c.links == (links if c.name != "process_results" else [])
            assert c.attributes["engine.batch_size"] == step.attributes["engine.batch_size"]
    # one prefill (all three fit one step) and a decode step per token after the first
    for r in results:
        rid = r["meta_info"]["id"]
        assert served[rid]["prefill"] == 1
        assert served[rid]["decode"] == r["meta_info"]["completion_tokens"] - 1
    prefill = [
        s
        for s in steps
        if s.attributes["engine.step.mode"] == "prefill"
        and set(s.attributes["engine.request_ids"]) & set(roots)
    ]
    assert len(prefill) == 1 and prefill[0].attributes["engine.batch_size"] == 3
    assert prefill[0].attributes["engine.step.tokens"] == sum(
        r["meta_info"]["prompt_tokens"] for r in results
    )


def test_caller_traceparent_becomes_the_parent(traced, receiver):
    parent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    out = traced.generate(
        "Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}, trace_context=parent
    )
    rid = out["meta_info"]["id"]
    outs = traced.generate(
        ["Hi", "Hey there"],
        {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        trace_context={"traceparent": parent, "tracestate": "vendor=abc"},
    )
    rid2, rid3 = (o["meta_info"]["id"] for o in outs)  # two requests at once in the caller's trace
    assert receiver.wait_for(_complete([rid, rid2, rid3], STAGES), SPAN_WAIT)
    spans = receiver.spans()
    for r in (rid, rid2, rid3):
        s = _request_spans(spans, r)
        assert s["root"].trace_id == CALLER_TRACE and s["root"].parent_span_id == CALLER_SPAN
        assert {x.trace_id for x in s.values()} == {CALLER_TRACE}
        assert all(s[name].parent_span_id == s["root"].span_id for name in STAGES)
    assert _root(spans, rid).span_id != _root(spans, rid2).span_id


def test_current_span_of_the_caller_becomes_the_parent(traced, receiver):
    from opentelemetry.sdk.trace import TracerProvider

    # the user's own OpenTelemetry, not exported here
    caller = TracerProvider().get_tracer("caller")
    with caller.start_as_current_span("handle http request") as span:
        out = traced.generate("Hi", {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        ctx = span.get_span_context()
    rid = out["meta_info"]["id"]
    assert receiver.wait_for(_complete([rid], STAGES), SPAN_WAIT)
    root = _root(receiver.spans(), rid)
    assert root.trace_id == f"{ctx.trace_id:032x}" and root.parent_span_id == f"{ctx.span_id:016x}"


@pytest.mark.parametrize(
    "bad",
    [
        "not-a-traceparent",
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        {"tracestate": "a=b"},
        42,
        f"00-{CALLER_TRACE.upper()}-{CALLER_SPAN}-01",  # W3C: lowercase hex only
    ],
)
def test_bad_trace_context_is_refused_before_queueing(traced, bad):
    before = traced.get_stats()["prompt_tokens"]
    with pytest.raises(ValueError, match="trace_context"):
        traced.generate("Hi", {"max_new_tokens": 2}, trace_context=bad)
    assert traced.get_stats()["prompt_tokens"] == before


def test_aborted_request_has_error_status(traced, receiver):
    stream = traced.generate(
        "Count: 1, 2, 3,",
        {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        stream=True,
    )
    first = next(iter(stream))
    rid = first["meta_info"]["id"]
    traced.abort(rid)
    chunks = list(stream)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert receiver.wait_for(
        _complete([rid], {"queue", "prefill", "decode", "detokenize"}), SPAN_WAIT
    )
    s = _request_spans(receiver.spans(), rid)
    for name in ("root", "decode", "detokenize"):
        assert s[name].status_code == 2, name  # ERROR
        assert "aborted by the caller" in s[name].status_message
        assert s[name].attributes["error.type"] == "abort"
    assert s["prefill"].status_code != 2
    assert s["root"].attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert (
        s["root"].attributes["gen_ai.usage.output_tokens"]
        == chunks[-1]["meta_info"]["completion_tokens"]
    )


class _RefuseSubmit:
    """A second user-process plugin whose submit hook refuses one request of a call (called after
    tracing's, which has begun that request's root span by then)."""

    @hookimpl(trylast=True)
    def engine_request_submitted(self, rid, request, sampling, trace_context):
        if rid == "refuse-me":
            raise RuntimeError("refused on purpose")


def test_a_call_failing_after_its_root_began_ends_that_root_with_an_error(traced, receiver):
    from engine.hooks import HookError
    from engine.hooks.runtime import plugin_manager, refresh

    refuser = _RefuseSubmit()
    plugin_manager().register(refuser, name="refuser")
    refresh()
    try:
        with pytest.raises(HookError, match="refused on purpose"):
            traced.generate(["One", "Two"], {"max_new_tokens": 2}, rid=["sent-not", "refuse-me"])
    finally:
        plugin_manager().unregister(refuser)
        refresh()
    ok = traced.generate("Three", {"max_new_tokens": 2, "temperature": 0}, rid="after-refusal")
    assert receiver.wait_for(_complete(["after-refusal"], STAGES), SPAN_WAIT)
    spans = receiver.spans()
    for rid in ("sent-not", "refuse-me"):  # both roots had begun; both end, with the error
        root = _root(spans, rid)
        assert root.status_code == 2 and root.attributes["error.type"] == "not_sent"
        assert "refused on purpose" in root.status_message
        # nothing was sent
        assert {s.name for s in spans if s.trace_id == root.trace_id} == {
            root.name,
            "tokenize",
        }
    assert ok["meta_info"]["completion_tokens"] == 2


def test_perfetto_and_timeline_commands(batch, receiver, tmp_path):
    from PIL import Image

    results, _ = batch
    # a copy: spans of earlier tests' last steps may still arrive
    path = str(tmp_path / "spans.jsonl")
    with receiver.lock:
        shutil.copy(receiver.out_path, path)
        count = receiver.span_count
    spans = read_spans(path)
    assert len(spans) == count
    out = tmp_path / "trace.json"
    cli = [sys.executable, "-m", "engine.cli", "trace"]
    run = subprocess.run(
        cli + ["perfetto", path, "-o", str(out)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert sorted(n.split(" ")[0] for n in names.values()) == sorted(ROLES)  # one track per process
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(spans)
    lanes: dict[tuple, list] = {}
    for e in xs:
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in lanes.values():  # within a lane, spans nest or follow each other (never cross)
        intervals.sort(key=lambda iv: (iv[0], -iv[1]))
        stack: list[float] = []
        for start, end in intervals:
            while stack and stack[-1] <= start + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, "spans cross in one lane"
            stack.append(end)
    rid = results[1]["meta_info"]["id"]
    png = tmp_path / "request.png"
    run = subprocess.run(
        cli + ["timeline", path, "--request", rid, "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert _root(spans, rid).trace_id in run.stdout
    with Image.open(png) as img:
        assert img.format == "PNG" and img.width == 1400 and img.height > 200
    run = subprocess.run(
        cli + ["timeline", path, "--request", "no-such-request", "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "no-such-request" in run.stderr
    run = subprocess.run(cli + ["list", path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    header, *rows = run.stdout.splitlines()
    # a column header first
    assert header.split() == [
        "trace",
        "id",
        "request",
        "id",
        "root",
        "span",
    ]
    assert (
        rid in run.stdout and _root(spans, rid).trace_id in run.stdout and len(rows) >= len(results)
    )


SCRIPT = textwrap.dedent(
    """
    import json
    from engine import Engine

    if __name__ == "__main__":
        engine = Engine(dtype="float32", max_total_tokens=2048)
        out = engine.generate(["Hello", "The sky is"], {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
        # a stop string: the result comes back before the scheduler has dropped the request
        until = {"max_new_tokens": 200, "temperature": 0, "stop": [" 10"]}
        stop = engine.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8,", until)
        assert stop["meta_info"]["finish_reason"]["matched"] == " 10", stop
        rids = [o["meta_info"]["id"] for o in out] + [stop["meta_info"]["id"]]
        print("RESULT " + json.dumps({"rids": rids, "pids": engine.pids}))
        # no shutdown: the script just ends
    """
)


def test_http_export_file_exporter_and_spans_delivered_when_the_script_just_ends(tmp_path):
    from helpers import wait_gone

    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    trace_file = tmp_path / "spans.jsonl"
    with OTLPReceiver() as rx:
        env = dict(
            os.environ,
            ENGINE_TRACING="1",
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_ENDPOINT=rx.http_endpoint,
            OTEL_TRACES_EXPORTER="otlp",
            ENGINE_TRACE_FILE=str(trace_file),
        )
        # the default 5 s: spans can only arrive by the exit flush
        env.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        run = subprocess.run(
            [sys.executable, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stderr
        result = json.loads(
            next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:]
        )
        assert not wait_gone(result["pids"].values(), 10)
        spans = rx.spans()
        assert rx.transports and set(rx.transports) == {"http"}
    # every request's spans from all three processes, the stop string's too
    for rid in result["rids"]:
        found = _request_spans(spans, rid)
        assert set(found) == STAGES | {"root"}, (rid, set(found))
        assert {s.pid for s in found.values()} == set(result["pids"].values())
        assert all(found[name].parent_span_id == found["root"].span_id for name in STAGES)
    assert any("engine.step.mode" in s.attributes for s in spans)
    # the file exporter wrote the same spans, from all three processes
    in_file = read_spans(str(trace_file))
    assert sorted(s.span_id for s in in_file) == sorted(s.span_id for s in spans)
    assert {s.role for s in in_file} == ROLES


def test_one_trace_per_beam_search_with_its_width_and_steps(traced, receiver):
    out = traced.beam_search(
        PROMPTS[1], beam_width=3, max_new_tokens=6, num_return_sequences=2, ignore_eos=True
    )
    rid = out["meta_info"]["id"]
    assert receiver.wait_for(
        _complete([rid], {"tokenize", "queue", "prefill", "beam_search"}), SPAN_WAIT
    )
    s = _request_spans(receiver.spans(), rid)
    # no per-token decode span
    assert set(s) == {
        "root",
        "tokenize",
        "queue",
        "prefill",
        "beam_search",
    }
    assert len({x.trace_id for x in s.values()}) == 1
    assert all(s[name].parent_span_id == s["root"].span_id for name in s if name != "root")
    for name in ("root", "beam_search"):
        assert s[name].attributes["engine.beam.width"] == 3
        assert s[name].attributes["engine.beam.steps"] == out["meta_info"]["steps"] == 6
    assert s["beam_search"].role == "scheduler"


class _HoldSubmit:
    """Holds the first submit of rid "dup" in its hook (after tracing's, which began the root) until
    the test releases it."""

    def __init__(self) -> None:
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0

    @hookimpl(trylast=True)
    def engine_request_submitted(self, rid, request, sampling, trace_context):
        if rid == "dup":
            self.calls += 1
            if self.calls == 1:
                self.entered.set()
                self.release.wait(60)


def test_two_calls_with_one_rid_at_once_leave_no_root_open(traced, receiver):
    """Before: both calls passed the clash check before either registered; the second's root replaced
    the first's in the plugin (never ended) and the first then failed, ending the second's root."""
    from engine.hooks.runtime import register

    holder = _HoldSubmit()
    register(holder, "holdsubmit")
    results: dict = {}

    def first() -> None:
        try:
            results["first"] = traced.generate(
                "One", {"max_new_tokens": 2, "temperature": 0}, rid="dup"
            )
        except Exception as exc:  # noqa: BLE001 - checked below
            results["first"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert holder.entered.wait(60)
        with pytest.raises(ValueError, match="already running"):  # refused before any hook saw it
            traced.generate("Two", {"max_new_tokens": 2, "temperature": 0}, rid="dup")
    finally:
        holder.release.set()
        thread.join(60)
        from engine.hooks.runtime import plugin_manager

        plugin_manager().unregister(name="holdsubmit")
    assert results["first"]["meta_info"]["completion_tokens"] == 2, results
    assert receiver.wait_for(_complete(["dup"], STAGES), SPAN_WAIT)
    s = _request_spans(receiver.spans(), "dup")  # one root (and one of each stage), ended, no error
    assert s["root"].status_code != 2 and s["root"].attributes[
        "gen_ai.response.finish_reasons"
    ] == ["length"]


class _FailOutput:
    @hookimpl
    def engine_output(self, result):
        if result["meta_info"]["id"] == "output-fails":
            raise KeyError("output refused on purpose")


def test_a_result_a_failing_output_hook_aborts_shows_the_error_in_its_trace(traced, receiver):
    """engine_output runs after the request ended (its root too); before, the trace of a result it
    marked aborted showed no error at all. Now an `output` span under the root carries it."""
    from engine.hooks.runtime import plugin_manager, register

    register(_FailOutput(), "failoutput")
    try:
        out = traced.generate("Hi", {"max_new_tokens": 2, "temperature": 0}, rid="output-fails")
    finally:
        plugin_manager().unregister(name="failoutput")
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert receiver.wait_for(_complete(["output-fails"], STAGES | {"output"}), SPAN_WAIT)
    s = _request_spans(receiver.spans(), "output-fails")
    output = s["output"]
    assert (
        output.role == "user"
        and output.parent_span_id == s["root"].span_id
        and output.trace_id == s["root"].trace_id
    )
    assert output.status_code == 2 and output.attributes["error.type"] == "abort"
    assert "'failoutput' failed in hook engine_output" in output.status_message
    assert "output refused on purpose" in output.status_message
    assert s["root"].end_ns <= output.start_ns <= output.end_ns


CUT_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from engine import Engine

    if __name__ == "__main__":
        a_dir, b_dir = sys.argv[1], sys.argv[2]
        a = Engine(model_path=a_dir, dtype="float32", max_running_requests=1, max_total_tokens=4096)
        b = Engine(model_path=b_dir, dtype="float32", max_total_tokens=1024)  # started last
        a.generate("Hello", {"max_new_tokens": 2, "temperature": 0}, rid="on-a")
        b.generate("Hello", {"max_new_tokens": 2, "temperature": 0}, rid="on-b")
        b.shutdown()
        params = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        running = a.generate("One two", params, stream=True, rid="running")
        next(running)  # admitted: the next one waits for the only slot
        waiting = a.generate("Three four", params, stream=True, rid="waiting")
        for _ in range(4):
            next(running)
        for _ in range(1200):  # until the scheduler holds it: on a loaded machine it came after the shutdown
            if a.get_stats()["tracked"]["scheduler"]["waiting"]:
                break
            time.sleep(0.05)
        pids = a.pids
        a.shutdown()  # cuts both
        print("RESULT " + json.dumps(pids))
    """
)


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory) -> tuple[dict, list[SpanRecord]]:
    """Two tiny engines in one script, traced to a file with ENGINE_TRACE_STEPS=0: a request on each,
    then a shutdown of the first while one request runs and another waits."""
    import shutil

    from conftest import save_tiny_model
    from engine.model.resolve import resolve_model_dir

    folder = tmp_path_factory.mktemp("cut")
    save_tiny_model("llama3-rope", folder / "model-a", resolve_model_dir(None))
    shutil.copytree(folder / "model-a", folder / "model-b")
    (folder / "run.py").write_text(CUT_SCRIPT)
    trace_file = folder / "spans.jsonl"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "ENGINE_PLUGINS"
    }
    env.update(ENGINE_TRACING="1", ENGINE_TRACE_FILE=str(trace_file), ENGINE_TRACE_STEPS="0")
    run = subprocess.run(
        [sys.executable, "run.py", str(folder / "model-a"), str(folder / "model-b")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    pids = json.loads(
        next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:]
    )
    return pids, read_spans(str(trace_file))


def test_requests_cut_by_a_shutdown_get_their_scheduler_spans(cut_run):
    """Before: only requests in a traced step were known at the scheduler's stop, so with
    ENGINE_TRACE_STEPS=0 the running request lost its queue, prefill and decode, and a waiting one
    (in no step at all) its queue, whatever the setting."""
    pids, spans = cut_run
    run, wait = _request_spans(spans, "running"), _request_spans(spans, "waiting")
    assert set(run) == {"root", "tokenize", "queue", "prefill", "decode", "detokenize"}, set(run)
    assert set(wait) == {"root", "tokenize", "queue"}, set(wait)
    for s in (run, wait):
        assert s["root"].status_code == 2 and s["root"].attributes["error.type"] == "engine_stopped"
        assert all(x.parent_span_id == s["root"].span_id for name, x in s.items() if name != "root")
    assert (
        run["decode"].attributes["engine.cut_by_shutdown"] is True
        and run["decode"].pid == pids["scheduler"]
    )
    assert (
        "engine.cut_by_shutdown" not in run["queue"].attributes
        and "engine.cut_by_shutdown" not in run["prefill"].attributes
    )
    assert (
        wait["queue"].attributes["engine.cut_by_shutdown"] is True
        and wait["queue"].pid == pids["scheduler"]
    )
    assert not any("engine.step.mode" in s.attributes for s in spans)  # ENGINE_TRACE_STEPS=0


def test_root_spans_name_the_model_of_their_own_engine(cut_run):
    """Before: the root took the model of the process's most recently started Engine."""
    _, spans = cut_run
    for rid, model in (("on-a", "model-a"), ("on-b", "model-b"), ("running", "model-a")):
        root = _root(spans, rid)
        assert (
            root.name == f"text_completion {model}"
            and root.attributes["gen_ai.request.model"] == model
        ), rid


def test_two_engines_running_one_rid_keep_their_root_spans_apart():
    """Roots were kept by rid: two engines in one process running one caller-given rid at once ended
    each other's root (the first to finish ended the other's, with its own counts; its own stayed open)."""
    plugin, memory = _one_rid_on_two_engines((11, 12))
    plugin.engine_request_done(
        rid="same",
        meta_info={"completion_tokens": 2, "finish_reason": {"type": "length"}},
        error=None,
        seq=12,
    )
    roots = [s for s in memory.get_finished_spans() if "gen_ai.operation.name" in s.attributes]
    assert len(roots) == 1 and roots[0].attributes["gen_ai.usage.output_tokens"] == 2
    plugin.engine_request_done(
        rid="same",
        meta_info={"completion_tokens": 4, "finish_reason": {"type": "length"}},
        error=None,
        seq=11,
    )
    roots = [s for s in memory.get_finished_spans() if "gen_ai.operation.name" in s.attributes]
    assert [r.attributes["gen_ai.usage.output_tokens"] for r in roots] == [2, 4] and roots[
        0
    ] is not roots[1]
    assert roots[0].context.trace_id != roots[1].context.trace_id


def test_a_failing_output_hook_puts_its_span_in_its_own_requests_trace():
    """The roots ended lately were kept by rid for a failing engine_output's `output` span: two engines
    in one process finishing one caller-given rid put the first one's error span in the second one's
    trace (and the second's got none). They are kept by the request's seq, which the hook now gets."""
    from engine.hooks import HookError

    plugin, memory = _one_rid_on_two_engines((21, 22))
    roots = {}
    for seq in (21, 22):
        plugin.engine_request_done(
            rid="same",
            meta_info={"id": "same", "finish_reason": {"type": "length"}},
            error=None,
            seq=seq,
        )
        roots[seq] = memory.get_finished_spans()[-1]
    for seq in (21, 22):
        wrapper = plugin.engine_output(result={"meta_info": {"id": "same"}}, seq=seq)
        next(wrapper)
        with pytest.raises(HookError):
            wrapper.throw(HookError("bad", "engine_output", ValueError(f"failed for {seq}")))
        output = memory.get_finished_spans()[-1]
        assert output.name == "output" and f"failed for {seq}" in output.status.description
        assert (
            output.context.trace_id == roots[seq].context.trace_id
            and output.parent.span_id == roots[seq].context.span_id
        )


def _one_rid_on_two_engines(seqs: tuple[int, int]):
    """A user process's tracing plugin exporting to memory, with one caller-given rid submitted to two
    engines (two seqs)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine.hooks.types import PromptRequest
    from engine.sampling_params import SamplingParams
    from engine.tracing.plugin import TracingPlugin

    memory = InMemorySpanExporter()
    plugin = TracingPlugin()
    plugin.provider = TracerProvider()
    plugin.provider.add_span_processor(SimpleSpanProcessor(memory))
    plugin.tracer = plugin.provider.get_tracer("t")
    for seq in seqs:
        plugin.engine_request_submitted(
            rid="same",
            request=PromptRequest(0, prompt="x", input_ids=[1, 2]),
            sampling=SamplingParams(max_new_tokens=4),
            trace_context={},
            seq=seq,
        )
    return plugin, memory

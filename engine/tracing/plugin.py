"""tracing: OpenTelemetry spans for every request, across the three processes, built on the hooks.

Loaded by ENGINE_TRACING=1 (or as the plugin `tracing`); when off it is not loaded at all, so it costs
nothing. Spans are made from the times the engine records anyway, after the fact with explicit start
and end times: nothing per token; per request a few spans when it ends; per scheduler step one short
trace with a link per request served (ENGINE_TRACE_STEPS=N keeps one step in N, 0 none).

    <op> <model>            user process, root (or child of the caller's trace_context)
    |- tokenize             user process
    |- queue                scheduler: arrival to first admission
    |- prefill              scheduler: admission to first token (all chunks)
    |- decode               scheduler: first token to finish
    |- detokenize           detokenizer: first output to last
    '- output               user process, only when another plugin's engine_output failed (the error)
    <mode> step             scheduler, one trace per step, linked to each request it served
    |- schedule, forward, sample (linked too), process_results
"""

from __future__ import annotations

import atexit
import collections
import threading
import time

from opentelemetry import context as otel_context
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace import set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.hooks import HookError, hookimpl
from engine.tracing.context import parse_traceparent

SCOPE = "engine"
FLUSH_SECONDS = 4.0  # a child has 5 s to stop before it is terminated
CUT = "engine.cut_by_shutdown"  # on the last span of a request the engine stopped before it finished here
# besides the step span: the stages that serve the batch
LINKED_STAGES = (
    "schedule",
    "forward",
    "sample",
)
ENDED_KEPT = 4096  # user process: roots ended lately, for an engine_output that fails after the end
_propagator = TraceContextTextMapPropagator()


def remote_span_context(headers: dict[str, str]) -> SpanContext | None:
    """The span a request's trace headers point at (its root span in the user process)."""
    parsed = parse_traceparent(headers.get("traceparent", "")) if headers else None
    if parsed is None:
        return None
    trace_id, span_id, flags = parsed
    state = TraceState.from_header([headers["tracestate"]]) if headers.get("tracestate") else None
    return SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 1), trace_state=state
    )


def _parent_context(headers: dict[str, str]):
    """The context whose current span is the request's root, for spans made in another process; an
    empty one (a new trace) when the request carries no trace headers."""
    sc = remote_span_context(headers)
    return otel_context.Context() if sc is None else set_span_in_context(NonRecordingSpan(sc))


def _request_attributes(sampling, model: str, operation: str) -> dict:
    attrs = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_new_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
    }
    if sampling.top_k > 0:
        attrs["gen_ai.request.top_k"] = sampling.top_k
    if sampling.seed is not None:
        attrs["gen_ai.request.seed"] = sampling.seed
    if sampling.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = sampling.frequency_penalty
    if sampling.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = sampling.presence_penalty
    if sampling.stop:
        attrs["gen_ai.request.stop_sequences"] = list(sampling.stop)
    return attrs


def _set_error(span, message: str, error_type: str = "abort") -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message))


class TracingPlugin:
    """One instance per process; what it does depends on the process's role."""

    def __init__(self) -> None:
        self.provider = None
        self.tracer = None
        self.role = ""
        self.model = (
            ""  # the process's last engine's: only for a request that does not carry its own
        )
        # spans a hook makes are made under it, so they are ended before the stop hook's flush or not made
        self.lock = threading.Lock()
        self.roots: dict[int, object] = {}  # user process: the request's seq -> its open root span
        # user process: seq -> the context of its ended root, for a failing engine_output (streams never
        # reach that hook, so the oldest are dropped)
        self.ended: collections.OrderedDict[int, SpanContext] = collections.OrderedDict()
        self.detok: dict[
            str, tuple[int, dict, str]
        ] = {}  # detokenizer: rid -> (first output ns, trace headers, rid)
        # scheduler: every request from its arrival to its finish, whatever ENGINE_TRACE_STEPS keeps, so
        # the stop hook can make the spans of those a shutdown cuts off, queued ones too
        self.live: dict[str, object] = {}
        self.links: dict[
            str, tuple
        ] = {}  # scheduler: rid -> (link to its root span, Req), while it runs
        self.stopped = False  # the stop hook made the spans of what was still running
        self.dirty = False  # user process: spans ended since the last flush
        self.step_every = 1  # scheduler: trace one step in this many (ENGINE_TRACE_STEPS; 0: none)
        self.steps_seen = 0

    # ------------------------------------------------------------------ life cycle (every process)

    @hookimpl
    def engine_process_start(self, role: str, pid: int) -> None:
        if self.provider is not None:  # a second Engine in the same process keeps the provider
            return
        from engine.tracing.setup import make_provider, step_sampling

        self.step_every = step_sampling()
        self.role = role
        self.provider = make_provider(role, pid)
        self.tracer = self.provider.get_tracer(SCOPE)
        if role == "user":
            atexit.register(self._flush_at_exit)

    @hookimpl
    def engine_process_ready(self, role: str, pid: int, info: dict) -> None:
        self.model = str(info.get("model", "")) or self.model

    @hookimpl
    def engine_process_stop(self, role: str, pid: int) -> None:
        """Spans of requests still running here (the user may already have their result: a stop
        string, or a script that ended), then flush. Runs beside the serving thread in a child."""
        if self.tracer is not None:
            with self.lock:
                self.stopped = True
                live = list(self.live.values())
                pending = list(self.detok.values())
                self.live.clear()
                self.links.clear()
                self.detok.clear()
            for req in live:  # finished here but not yet through its finish hook: it ends as it did
                finished = req.finished
                self._request_spans(req, None if finished is None else finished.to_dict())
            for start, headers, rid in pending:
                self._detokenize_span(rid, start, headers, None, None)
        self.flush()

    def _flush_at_exit(self) -> None:
        if self.dirty:  # spans ended since the last flush (an engine still open closes after this)
            self.flush()

    def flush(self) -> None:
        """force_flush ignores its timeout in the SDK (it exports in the calling thread): bound it here,
        so a collector that does not answer cannot hold a shutdown. Where no thread can start (Python 3.12
        at interpreter shutdown, where the user process's last flush runs), it flushes in this thread."""
        self.dirty = False
        if self.provider is not None:
            worker = threading.Thread(
                target=self.provider.force_flush, name="engine-trace-flush", daemon=True
            )
            try:
                worker.start()
            except RuntimeError:
                self.provider.force_flush(int(FLUSH_SECONDS * 1000))
                return
            worker.join(FLUSH_SECONDS)

    # ------------------------------------------------------------------ user process

    @hookimpl
    def engine_request_submitted(
        self, rid: str, request, sampling, trace_context: dict, seq: int
    ) -> None:
        if self.tracer is None:
            return
        # None: current
        parent = _propagator.extract(trace_context) if "traceparent" in trace_context else None
        operation = "chat" if request.messages is not None else "text_completion"
        model = getattr(request, "model", "") or self.model  # the request's own engine's model
        attrs = _request_attributes(sampling, model, operation)
        attrs["engine.request_id"] = attrs["gen_ai.response.id"] = rid
        start = request.tokenize_start_ns or time.time_ns()
        root = self.tracer.start_span(
            f"{operation} {model}".strip(), context=parent, attributes=attrs, start_time=start
        )
        ctx = set_span_in_context(root)
        tokenize = self.tracer.start_span(
            "tokenize",
            context=ctx,
            start_time=start,
            attributes={
                "engine.request_id": rid,
                "gen_ai.usage.input_tokens": len(request.input_ids or ()),
            },
        )
        tokenize.end(end_time=request.tokenize_end_ns or time.time_ns())
        for key in ("traceparent", "tracestate"):
            trace_context.pop(key, None)
        _propagator.inject(trace_context, context=ctx)
        with self.lock:
            self.roots[seq] = root  # by seq: two engines in this process may run one rid at once
        self.dirty = True

    @hookimpl
    def engine_request_done(self, rid: str, meta_info: dict, error: str | None, seq: int) -> None:
        with self.lock:
            root = self.roots.pop(seq, None)
        if root is None:
            return
        finish = meta_info.get("finish_reason") or {}
        root.set_attributes(
            {
                "gen_ai.usage.input_tokens": meta_info.get("prompt_tokens", 0),
                "gen_ai.usage.output_tokens": meta_info.get("completion_tokens", 0),
                "gen_ai.response.finish_reasons": [
                    finish.get("type", "error" if error else "unknown")
                ],
                "engine.cached_tokens": meta_info.get("cached_tokens", 0),
                "engine.time_to_first_token_s": float(meta_info.get("first_token_latency", 0.0)),
            }
        )
        if "beam_width" in meta_info:  # a beam search
            root.set_attributes(
                {
                    "engine.beam.width": meta_info["beam_width"],
                    "engine.beam.steps": meta_info["steps"],
                }
            )
        # never sent (a later hook or check failed), or the engine stopped first
        if error is not None:
            _set_error(
                root, error, "not_sent" if error.startswith("not sent:") else "engine_stopped"
            )
        elif finish.get("type") == "abort":
            _set_error(root, str(finish.get("message", "aborted")))
        root.end()
        if error is None:
            with self.lock:
                self.ended[seq] = root.get_span_context()
                if len(self.ended) > ENDED_KEPT:
                    self.ended.popitem(last=False)
        self.dirty = True

    @hookimpl(wrapper=True, tryfirst=True)
    def engine_output(self, result: dict, seq: int):
        """Around the other plugins' engine_output: the request ended (its root too) before this stage,
        so a result a failing hook marks aborted gets an `output` span with the error, under its root."""
        with self.lock:
            sc = self.ended.pop(seq, None)
        start = time.time_ns()
        try:
            return (yield)
        except HookError as exc:
            if sc is not None and self.tracer is not None:
                rid = result.get("meta_info", {}).get("id", "")
                span = self.tracer.start_span(
                    "output",
                    context=set_span_in_context(NonRecordingSpan(sc)),
                    start_time=start,
                    attributes={"engine.request_id": rid},
                )
                _set_error(span, str(exc))
                span.end()
                self.dirty = True
            raise

    # ------------------------------------------------------------------ scheduler

    def _link(self, req) -> Link | None:
        """Under the lock, before the stop hook (only _step_spans calls it)."""
        entry = self.links.get(req.rid)
        if entry is None:
            sc = remote_span_context(req.trace_context)
            # no link attributes: they triple a link's cost
            entry = (
                None if sc is None else Link(sc),
                req,
            )
            if req.finished is None:  # cached while it runs; dropped when it finishes
                self.links[req.rid] = entry
        return entry[0]

    @hookimpl
    def engine_request_arrived(self, req) -> None:
        if self.tracer is None:
            return
        with self.lock:
            if not self.stopped:
                self.live[req.rid] = req

    @hookimpl
    def engine_request_finished(self, req, finish_reason: dict) -> None:
        if self.tracer is None:
            return
        with self.lock:
            self.links.pop(req.rid, None)
            if self.stopped:  # the stop hook made its spans already
                return
            if self.live.get(req.rid) is req:  # a rid reused after this one is another request
                del self.live[req.rid]
            # under the lock: before the stop hook's flush, not after
            self._request_spans(req, finish_reason)

    def _request_spans(self, req, finish_reason: dict | None) -> None:
        """queue, prefill, decode from the request's recorded times; finish_reason None: cut by shutdown."""
        parent = _parent_context(req.trace_context)
        now, rid = time.time_ns(), req.rid
        kind = "unknown" if finish_reason is None else finish_reason.get("type", "unknown")
        queue_end = req.admitted_ns or now
        stages = [("queue", req.arrived_ns or queue_end, queue_end, {"engine.request_id": rid})]
        if req.admitted_ns:
            stages.append(
                (
                    "prefill",
                    req.admitted_ns,
                    req.first_token_ns or now,
                    {
                        "engine.request_id": rid,
                        "gen_ai.usage.input_tokens": req.prompt_len,
                        "engine.cached_tokens": req.cached_tokens,
                    },
                )
            )
        if req.beam is not None and req.first_token_ns:  # one span for the whole search
            stages.append(
                (
                    "beam_search",
                    req.first_token_ns,
                    now,
                    {
                        "engine.request_id": rid,
                        "engine.beam.width": req.beam.width,
                        "engine.beam.steps": req.beam_steps,
                        "gen_ai.response.finish_reasons": [kind],
                    },
                )
            )
        elif req.first_token_ns and (
            len(req.output_ids) > 1 or kind != "stop" and kind != "length"
        ):
            decode = {
                "engine.request_id": rid,
                "gen_ai.usage.output_tokens": len(req.output_ids),
                "engine.retractions": max(req.admissions - 1, 0),
            }
            if finish_reason is not None:
                decode["gen_ai.response.finish_reasons"] = [kind]
            stages.append(("decode", req.first_token_ns, now, decode))
        for k, (name, start, stop, attrs) in enumerate(stages):
            span = self.tracer.start_span(name, context=parent, start_time=start, attributes=attrs)
            if name == "queue" and req.received_ns:
                span.add_event("received by the scheduler", timestamp=req.received_ns)
            if k == len(stages) - 1:  # where it ended
                if finish_reason is None:
                    span.set_attribute(CUT, True)
                elif kind == "abort":
                    _set_error(span, str(finish_reason.get("message", "aborted")))
            span.end(end_time=stop)

    @hookimpl
    def engine_step_end(self, step) -> None:
        if self.tracer is None:
            return
        self.steps_seen += 1
        if step.error is None and (not self.step_every or self.steps_seen % self.step_every):
            return  # one step in step_every (0: none), and every failed step
        with self.lock:  # the stop hook sets `stopped` under this lock, then flushes: a step ends
            # wholly before that flush, or is not traced (the process exits after it)
            if not self.stopped:
                self._step_spans(step)

    def _step_spans(self, step) -> None:
        links = [link for link in map(self._link, step.reqs) if link is not None]
        attrs = {
            "engine.step.mode": step.mode,
            "engine.batch_size": len(step.reqs),
            "engine.step.tokens": step.tokens,
        }
        root = self.tracer.start_span(
            f"{step.mode} step",
            context=otel_context.Context(),
            start_time=step.schedule_start_ns,
            attributes={**attrs, "engine.request_ids": [r.rid for r in step.reqs]},
            links=links,
        )
        if not root.is_recording():
            return
        ctx = set_span_in_context(root)
        end = step.end_ns
        stages = [
            ("schedule", step.schedule_start_ns, step.forward_start_ns),
            ("forward", step.forward_start_ns, step.sample_start_ns or end),
        ]
        if step.sample_start_ns is not None:
            stages.append(("sample", step.sample_start_ns, step.results_start_ns or end))
        if step.results_start_ns is not None:
            stages.append(("process_results", step.results_start_ns, end))
        for name, start, stop in stages:
            linked = links if name in LINKED_STAGES else None
            span = self.tracer.start_span(
                name, context=ctx, start_time=start, attributes=attrs, links=linked
            )
            if step.error is not None and name == stages[-1][0]:
                _set_error(span, step.error, "step_failed")
            span.end(end_time=stop)
        if step.error is not None:
            _set_error(root, step.error, "step_failed")
        root.end(end_time=end)

    # ------------------------------------------------------------------ detokenizer

    @hookimpl
    def engine_detokenize_output(self, output) -> None:
        if self.tracer is None:
            return
        now = time.time_ns()
        with self.lock:
            if self.stopped:
                return
            if output.headers:
                for rid, header in zip(output.rids, output.headers):
                    if header is not None:
                        self.detok[rid] = (now, header.trace_context, rid)
            for i in [i for i, f in enumerate(output.finished) if f is not None]:
                started = self.detok.pop(output.rids[i], None)
                # its span made under the lock: before the stop hook's flush
                if started is not None:
                    start, headers, rid = started
                    self._detokenize_span(
                        rid, start, headers, output.finished[i], output.meta[i], now
                    )

    def _detokenize_span(
        self, rid: str, start: int, headers: dict, finish, meta, end: int | None = None
    ) -> None:
        parent = _parent_context(headers)
        attrs: dict = {"engine.request_id": rid}
        if finish is not None:
            attrs["gen_ai.response.finish_reasons"] = [finish.type]
        if meta is not None:
            attrs["gen_ai.usage.output_tokens"] = meta.completion_tokens
        span = self.tracer.start_span(
            "detokenize", context=parent, start_time=start, attributes=attrs
        )
        if finish is None:
            span.set_attribute(CUT, True)
        elif finish.type == "abort":
            _set_error(span, finish.message or "aborted")
        span.end(end_time=end or time.time_ns())

"""OTLP/JSON spans -> a Chrome trace-event file (open it in https://ui.perfetto.dev or chrome://tracing).

One process track per engine process (named by role and pid), ordered user, scheduler, detokenizer.
Inside a process, each request's spans share a lane (they nest or follow each other), and requests
that overlap in time get separate lanes, also when they share a trace (a caller's trace context);
the scheduler's steps run one after another on a lane of their own.
"""

from __future__ import annotations

import json
from collections import defaultdict

from engine.tracing.otlp_json import SpanRecord

ROLE_ORDER = {"user": 0, "scheduler": 1, "detokenizer": 2}


def _is_step(span: SpanRecord) -> bool:
    return "engine.step.mode" in span.attributes


def _group(span: SpanRecord) -> str:
    """What shares a lane: a request's spans (by request id), else a trace's."""
    rid = span.attributes.get("engine.request_id")
    return f"request:{rid}" if rid is not None else f"trace:{span.trace_id}"


def _lanes(spans: list[SpanRecord]) -> dict[str, int]:
    """group -> lane within one process: greedy interval packing of each group's extent."""
    extent: dict[str, list[int]] = {}
    for s in spans:
        e = extent.setdefault(_group(s), [s.start_ns, s.end_ns])
        e[0], e[1] = min(e[0], s.start_ns), max(e[1], s.end_ns)
    lane_end: list[int] = []
    out: dict[str, int] = {}
    for group, (start, end) in sorted(extent.items(), key=lambda kv: kv[1][0]):
        for lane, last in enumerate(lane_end):
            if last <= start:
                lane_end[lane] = end
                out[group] = lane
                break
        else:
            out[group] = len(lane_end)
            lane_end.append(end)
    return out


def to_chrome_trace(spans: list[SpanRecord]) -> dict:
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(s.start_ns for s in spans)
    events: list[dict] = []
    processes: dict[int, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        processes[s.pid].append(s)
    for pid, group in processes.items():
        role = group[0].role
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{role} (pid {pid})"}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "args": {"sort_index": ROLE_ORDER.get(role, 9)},
            }
        )
        steps = [s for s in group if _is_step(s)]
        others = [s for s in group if not _is_step(s)]
        lanes = _lanes(others)
        base = 1 if steps else 0
        if steps:
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "steps"}}
            )
        for lane in range(max(lanes.values(), default=-1) + 1):
            tid = base + lane + 1
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": tid,
                    "args": {"name": f"requests {lane + 1}"},
                }
            )
        for s in group:
            tid = 1 if _is_step(s) else base + lanes[_group(s)] + 1
            args = {
                "trace_id": s.trace_id,
                "span_id": s.span_id,
                **{k: _plain(v) for k, v in s.attributes.items()},
            }
            if s.parent_span_id:
                args["parent_span_id"] = s.parent_span_id
            if s.links:
                args["links"] = len(s.links)
            if s.status_code == 2:
                args["error"] = s.status_message or "error"
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.role,
                    "pid": pid,
                    "tid": tid,
                    "ts": (s.start_ns - t0) / 1000.0,
                    "dur": max(s.duration_ns, 0) / 1000.0,
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0_unix_ns": t0}}


def _plain(value):
    return (
        value if isinstance(value, (str, int, float, bool)) or value is None else json.dumps(value)
    )


def write_chrome_trace(spans: list[SpanRecord], path: str) -> int:
    """Write the trace-event JSON; returns the number of span events."""
    data = to_chrome_trace(spans)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return sum(1 for e in data["traceEvents"] if e["ph"] == "X")

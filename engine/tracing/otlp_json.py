"""OTLP/JSON: the file format of the file exporter, the receiver's output and the converters' input.

One line per export batch, each an ExportTraceServiceRequest in the OTLP/JSON encoding (lowerCamelCase
fields, trace and span ids as hex, 64-bit integers as strings), the format the OpenTelemetry
Collector's file exporter writes. `read_spans` flattens such a file into SpanRecords.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Iterable

from google.protobuf import json_format

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _map_ids(node, convert) -> None:
    """Apply convert to every trace/span id in a JSON tree, in place."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_FIELDS and isinstance(value, str):
                node[key] = convert(value)
            else:
                _map_ids(value, convert)
    elif isinstance(node, list):
        for item in node:
            _map_ids(item, convert)


def ids_to_base64(node) -> None:
    """OTLP/JSON's hex ids as protobuf's JSON parser wants them (base64), in place."""
    _map_ids(node, lambda v: base64.b64encode(bytes.fromhex(v)).decode("ascii"))


def request_to_dict(request) -> dict:
    """An ExportTraceServiceRequest (protobuf) as an OTLP/JSON dict."""
    data = json_format.MessageToDict(request, use_integers_for_enums=True)
    _map_ids(data, lambda v: base64.b64decode(v).hex())  # protobuf's JSON writes bytes as base64
    return data


def spans_to_line(spans) -> str:
    """SDK ReadableSpans as one OTLP/JSON line."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return json.dumps(request_to_dict(encode_spans(spans)), separators=(",", ":"))


@dataclass
class SpanRecord:
    """One span, flattened, with its resource's attributes (the process it came from)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict
    resource: dict
    links: list[dict] = field(default_factory=list)  # {"trace_id", "span_id", "attributes"}
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    status_message: str = ""
    events: list[dict] = field(default_factory=list)  # {"name", "time_ns", "attributes"}

    @property
    def role(self) -> str:
        return str(self.resource.get("engine.process.role", "?"))

    @property
    def pid(self) -> int:
        return int(self.resource.get("process.pid", 0))

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _value(v: dict):
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return _attributes(v["kvlistValue"].get("values", []))
    return None


def _attributes(items: list) -> dict:
    return {kv["key"]: _value(kv.get("value", {})) for kv in items or []}


def records_from_dict(data: dict) -> list[SpanRecord]:
    """The spans of one OTLP/JSON ExportTraceServiceRequest."""
    out = []
    for rs in data.get("resourceSpans", []):
        resource = _attributes(rs.get("resource", {}).get("attributes", []))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                status = s.get("status", {})
                out.append(
                    SpanRecord(
                        trace_id=s.get("traceId", ""),
                        span_id=s.get("spanId", ""),
                        parent_span_id=s.get("parentSpanId", ""),
                        name=s.get("name", ""),
                        start_ns=int(s.get("startTimeUnixNano", 0)),
                        end_ns=int(s.get("endTimeUnixNano", 0)),
                        attributes=_attributes(s.get("attributes", [])),
                        resource=resource,
                        links=[
                            {
                                "trace_id": ln.get("traceId", ""),
                                "span_id": ln.get("spanId", ""),
                                "attributes": _attributes(ln.get("attributes", [])),
                            }
                            for ln in s.get("links", [])
                        ],
                        status_code=int(status.get("code", 0)),
                        status_message=status.get("message", ""),
                        events=[
                            {
                                "name": e.get("name", ""),
                                "time_ns": int(e.get("timeUnixNano", 0)),
                                "attributes": _attributes(e.get("attributes", [])),
                            }
                            for e in s.get("events", [])
                        ],
                    )
                )
    return out


def read_spans(path: str) -> list[SpanRecord]:
    """Every span in an OTLP/JSON lines file, in file order."""
    with open(path, encoding="utf-8") as f:
        return records_from_lines(f)


def records_from_lines(lines: Iterable[str]) -> list[SpanRecord]:
    out: list[SpanRecord] = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            out += records_from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"line {n} is not an OTLP/JSON trace export: {exc}") from exc
    return out

"""W3C trace context as plain strings: what travels in the engine's messages.

Checked here without OpenTelemetry, so a caller's bad traceparent is refused even when tracing is off.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a valid W3C traceparent, else None."""
    # W3C: lowercase hex only
    m = _TRACEPARENT.match(value.strip()) if isinstance(value, str) else None
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if (
        version == "ff"
        or (version == "00" and rest)
        or int(trace_id, 16) == 0
        or int(span_id, 16) == 0
    ):
        return None
    return int(trace_id, 16), int(span_id, 16), int(flags, 16)


def normalize_trace_context(value) -> dict[str, str]:
    """The caller's trace_context (a traceparent string, or a mapping of W3C headers such as
    {"traceparent": ..., "tracestate": ...}) as the dict the messages carry. Raises ValueError."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = {"traceparent": value}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"trace_context must be a W3C traceparent string or a dict of trace headers, got {type(value).__name__}"
        )
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise ValueError(
                f"trace_context must map header names to strings, got {key!r}: {item!r}"
            )
        out[key.lower()] = item
    if "traceparent" not in out:
        raise ValueError("trace_context needs a 'traceparent' entry (W3C trace context)")
    if parse_traceparent(out["traceparent"]) is None:
        raise ValueError(
            f"trace_context: {out['traceparent']!r} is not a valid W3C traceparent "
            "(00-<32 hex trace id>-<16 hex span id>-<2 hex flags>, ids not all zero)"
        )
    return out


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"

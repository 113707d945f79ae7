"""Per-process OpenTelemetry set-up, from the standard OTEL_* variables.

    OTEL_TRACES_EXPORTER        otlp (default), console, none; comma-separated for several
    OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL   grpc (default) or http/protobuf
    OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / _HEADERS / _TIMEOUT / _COMPRESSION   read by the exporters
    OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG      read by the SDK (default parentbased_always_on)
    OTEL_BSP_*                  the batch span processor's queue, batch size and delay
    OTEL_SPAN_LINK_COUNT_LIMIT  links per span (default here 4096, not the SDK's 128: a step links every request)
    OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES       the resource (service.name defaults to "engine")
    ENGINE_TRACE_FILE           also append OTLP/JSON lines to this file (then the default exporter is none)
    ENGINE_TRACE_STEPS          trace one scheduler step in N (default 1: every step; 0: no step traces)

The provider is the process's own: the global one (a user's own OpenTelemetry set-up) is left alone.
"""

from __future__ import annotations

import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from engine import envvars

FILE_ENV = "ENGINE_TRACE_FILE"
STEPS_ENV = "ENGINE_TRACE_STEPS"
SERVICE_NAME = "engine"
# a step span links to every request it served; the SDK's default of 128 links would cut big batches
MAX_LINKS = 4096


def _env(*names: str, default: str = "") -> str:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return default


def _otlp_exporter() -> SpanExporter:
    protocol = _env(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL", default="grpc"
    ).lower()
    return _otlp_for(protocol)


def _otlp_for(protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use grpc or http/protobuf "
        "(the Python OTLP exporter has no http/json)"
    )


def make_exporters() -> list[SpanExporter]:
    """The exporters the variables ask for (ValueError naming a bad value)."""
    from engine.tracing.file_exporter import FileSpanExporter

    path = envvars.read(FILE_ENV)
    names = [
        n.strip().lower()
        for n in _env("OTEL_TRACES_EXPORTER", default="none" if path else "otlp").split(",")
    ]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            exporters.append(_otlp_exporter())
        elif name in ("otlp_proto_grpc", "otlp_proto_http"):  # the Python SDK's own exporter names
            exporters.append(_otlp_for("grpc" if name.endswith("grpc") else "http/protobuf"))
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name not in ("none", ""):
            raise ValueError(
                f"OTEL_TRACES_EXPORTER={name!r} is not supported: use otlp (or otlp_proto_grpc, otlp_proto_http), "
                "console or none"
            )
    if path:
        exporters.append(FileSpanExporter(path))
    return exporters


def step_sampling() -> int:
    """ENGINE_TRACE_STEPS: trace one step in this many (0: none). Failed steps are always traced."""
    raw = envvars.read(STEPS_ENV) or "1"
    if not raw.isdigit():
        raise ValueError(
            f"{STEPS_ENV}={raw!r}: give a whole number of steps (1: every step, 0: none)"
        )
    return int(raw)


def make_resource(role: str, pid: int) -> Resource:
    """service.name (OTEL_SERVICE_NAME, else "engine"), the process's role and pid, OTEL_RESOURCE_ATTRIBUTES."""
    resource = Resource.create({"engine.process.role": role, "process.pid": pid})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    return resource


def make_provider(role: str, pid: int) -> TracerProvider:
    # no shutdown at interpreter exit: spans of requests that the engine's own exit handler ends would
    # be dropped by a provider shut down before it; the plugin flushes instead
    limits = (
        None if os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT") else SpanLimits(max_links=MAX_LINKS)
    )
    provider = TracerProvider(
        resource=make_resource(role, pid), shutdown_on_exit=False, span_limits=limits
    )
    for exporter in make_exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider

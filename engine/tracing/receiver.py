"""A small OTLP trace receiver on 127.0.0.1: gRPC (the TraceService from opentelemetry-proto) and
HTTP (POST /v1/traces, protobuf or JSON). It keeps what it receives and can append it to an
OTLP/JSON lines file. The tests and the tracing benchmark export to it; `engine trace receive`
runs it as a stand-in for a collector when no Jaeger is at hand.
"""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf import json_format
from google.rpc import status_pb2  # googleapis-common-protos, a dependency of the OTLP exporters
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from engine.tracing.otlp_json import SpanRecord, ids_to_base64, records_from_dict, request_to_dict

ExportRequest = trace_service_pb2.ExportTraceServiceRequest


class OTLPReceiver:
    """with OTLPReceiver() as rx: ... rx.grpc_endpoint, rx.http_endpoint, rx.spans()"""

    def __init__(
        self,
        grpc_port: int = 0,
        http_port: int = 0,
        out_path: str | None = None,
        host: str = "127.0.0.1",
        keep: bool = True,
    ) -> None:
        """keep=False: the messages are written to out_path (if any) and counted, not kept (`engine trace
        receive`, which may run for days: spans() then has nothing)."""
        self.host = host
        self.out_path = out_path
        self.keep = keep
        self.export_count = 0
        self.lock = threading.Lock()
        self.requests: list = []  # ExportTraceServiceRequest messages, in arrival order
        self._dicts: list[dict] = []  # their OTLP/JSON form, converted when first asked for
        self.span_count = 0
        self.transports: list[str] = []  # "grpc" or "http", per request
        self.arrived = threading.Condition(self.lock)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._grpc)
        try:  # grpcio raises RuntimeError for a port in use (older versions returned 0)
            self.grpc_port = self._grpc.add_insecure_port(f"{host}:{grpc_port}")
        except RuntimeError as exc:
            raise OSError(
                f"cannot listen for OTLP/gRPC on {host}:{grpc_port} (in use?): {exc}"
            ) from None
        if not self.grpc_port:
            raise OSError(f"cannot listen for OTLP/gRPC on {host}:{grpc_port}")
        try:
            self._http = ThreadingHTTPServer((host, http_port), _handler(self))
        except OSError as exc:
            raise OSError(
                f"cannot listen for OTLP/HTTP on {host}:{http_port}: {exc.strerror or exc}"
            ) from None
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(
            target=self._http.serve_forever, name="otlp-http", daemon=True
        )

    @property
    def grpc_endpoint(self) -> str:
        return f"http://{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def start(self) -> "OTLPReceiver":
        self._grpc.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(grace=1).wait()
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add(self, request, transport: str) -> None:
        """Keep the message; the (pure Python, slow) JSON conversion waits until someone asks, unless
        a file is being written, so a receiver on the same machine takes little CPU from the engine."""
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.export_count += 1
            self.span_count += n
            if self.keep:
                self.requests.append(request)
                self.transports.append(transport)
            if self.out_path:
                data = self._as_dicts()[-1] if self.keep else request_to_dict(request)
                with open(self.out_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(data, separators=(",", ":")) + "\n")
            self.arrived.notify_all()

    def _as_dicts(self) -> list[dict]:
        """Under the lock: every request received so far, as OTLP/JSON dicts."""
        for request in self.requests[len(self._dicts) :]:
            self._dicts.append(request_to_dict(request))
        return self._dicts

    def spans(self) -> list[SpanRecord]:
        with self.lock:
            dicts = list(self._as_dicts())
        return [span for data in dicts for span in records_from_dict(data)]

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()
            self._dicts.clear()
            self.transports.clear()
            self.span_count = 0

    def wait_for(self, predicate, timeout: float) -> bool:
        """Block until predicate(spans) is true or the timeout passes; returns whether it became true."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            if predicate(self.spans()):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self.lock:
                self.arrived.wait(min(remaining, 0.5))


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        self.receiver.add(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


def _handler(receiver: OTLPReceiver):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/traces":
                self.send_error(404, "only /v1/traces is served")
                return
            body = self._body()
            if body is None:
                return
            encoding = (self.headers.get("Content-Encoding") or "").lower()
            # the reply is encoded the same way
            as_json = "json" in (self.headers.get("Content-Type") or "")
            request = ExportRequest()
            try:
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if as_json:
                    data = json.loads(body)
                    ids_to_base64(data)
                    json_format.ParseDict(data, request, ignore_unknown_fields=True)
                else:
                    request.ParseFromString(body)
            except Exception as exc:  # noqa: BLE001 - a bad body is the client's problem
                self._reply(
                    400,
                    as_json,
                    status_pb2.Status(code=3, message=f"not an ExportTraceServiceRequest: {exc}"),
                )
                return
            receiver.add(request, "http")
            self._reply(200, as_json, trace_service_pb2.ExportTraceServiceResponse())

        def _body(self) -> bytes | None:
            """The request's body: by its Content-Length, or chunked; None when answered already (411 or
            400: an exporter must know its spans were not taken)."""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                parts = []
                while True:
                    line = self.rfile.readline().split(b";")[0].strip() or b"0"
                    try:
                        size = int(line, 16)
                    except ValueError:
                        self.send_error(
                            400, f"chunk size {line[:32]!r} is not a hexadecimal length"
                        )
                        return None
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                            pass
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()  # the chunk's CRLF
            length = self.headers.get("Content-Length")
            if length is None:
                self.send_error(411, "a Content-Length or a chunked body is needed")
                return None
            if not length.strip().isdigit():
                self.send_error(400, f"Content-Length {length!r} is not a length")
                return None
            return self.rfile.read(int(length))

        def _reply(self, code: int, as_json: bool, message) -> None:
            """OTLP/HTTP: the response's Content-Type is the request's (JSON or protobuf); an error
            carries a google.rpc.Status."""
            if as_json:
                body, kind = (
                    json.dumps(json_format.MessageToDict(message)).encode(),
                    "application/json",
                )
            else:
                body, kind = message.SerializeToString(), "application/x-protobuf"
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            """Quiet: one line per export would drown the caller's output."""

    return Handler

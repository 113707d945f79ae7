"""A span exporter that appends OTLP/JSON lines to a file (ENGINE_TRACE_FILE).

All three processes append to the same file; each batch is one line, written under an exclusive
lock so lines never interleave.
"""

from __future__ import annotations

import fcntl
import logging
import os
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from engine.tracing.otlp_json import spans_to_line

logger = logging.getLogger(__name__)


class FileSpanExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise ValueError(f"ENGINE_TRACE_FILE={path!r}: the folder {parent!r} does not exist")
        self._warned = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        data = (spans_to_line(spans) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, data)
            finally:
                os.close(fd)  # closing releases the lock
        except OSError as exc:  # a full or read-only disk: spans are dropped, requests are not
            if not self._warned:
                self._warned = True
                logger.warning(
                    "engine: ENGINE_TRACE_FILE=%r cannot be written (%s); spans are dropped until it can "
                    "(requests are served as usual)",
                    self.path,
                    exc,
                )
            return SpanExportResult.FAILURE
        self._warned = False  # written again: warn again at the next failure
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release: the file is opened for each export."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

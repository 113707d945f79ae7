"""ENGINE_TRACING: the on switch (kept apart so checking it imports nothing of OpenTelemetry)."""

from __future__ import annotations

import os

ENV = "ENGINE_TRACING"


def tracing_enabled() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 1 (on) or 0 (off)")

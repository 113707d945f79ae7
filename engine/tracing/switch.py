"""ENGINE_TRACING: the on switch (kept apart so checking it imports nothing of OpenTelemetry)."""

from __future__ import annotations

from engine import envvars

ENV = "ENGINE_TRACING"


def tracing_enabled() -> bool:
    """1: on; 0 or unset: off; anything else stops the start with an error naming the variable."""
    value = envvars.read(ENV)
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{ENV}={value!r}: use 1 (on) or 0 (off)")

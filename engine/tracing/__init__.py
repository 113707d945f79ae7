"""OpenTelemetry tracing across the engine's three processes (docs/tracing.md).

switch.py and context.py import nothing of OpenTelemetry; the rest is loaded only with tracing on
(plugin.py, setup.py) or by the `engine trace` commands (receiver, perfetto, timeline).
"""

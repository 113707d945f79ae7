"""Errors a caller of the engine can catch by type."""


class EngineError(RuntimeError):
    """Base class of the engine's own errors."""


class EngineStartError(EngineError):
    """A child process failed to start; the message carries the child's own error text."""


class EngineDeadError(EngineError):
    """A child process died: pending and later requests cannot be served by this engine."""

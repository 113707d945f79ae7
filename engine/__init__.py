"""A small, fast, hookable LLM inference engine (tokenizer manager, scheduler, detokenizer over ZeroMQ)."""

from engine.errors import EngineDeadError, EngineError, EngineStartError

__all__ = ["Engine", "EngineDeadError", "EngineError", "EngineStartError"]


def __getattr__(name: str):
    """Engine on first use: the scheduler and detokenizer processes import this package too, and need
    none of the user-side modules behind Engine (0.2 s of every child's start-up)."""
    if name == "Engine":
        from engine.entrypoint import Engine

        return Engine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

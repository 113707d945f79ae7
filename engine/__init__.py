"""A small, fast, hookable LLM inference engine (tokenizer manager, scheduler, detokenizer over ZeroMQ)."""

from engine.errors import EngineDeadError, EngineError, EngineStartError

__all__ = ["Engine", "EngineDeadError", "EngineError", "EngineStartError", "SamplingParams"]


def __getattr__(name: str):
    """Engine and SamplingParams on first use: the scheduler and detokenizer processes import this
    package too, and need none of the user-side modules behind Engine."""
    if name == "Engine":
        from engine.frontend.engine import Engine

        return Engine
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")

"""A small, fast, hookable LLM inference engine (tokenizer manager, scheduler, detokenizer over ZeroMQ)."""

from engine.entrypoint import Engine
from engine.errors import EngineDeadError, EngineError, EngineStartError

__all__ = ["Engine", "EngineDeadError", "EngineError", "EngineStartError"]

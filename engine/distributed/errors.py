"""The error that ends a tensor-parallel rank (no torch here: the scheduler names it at import)."""

from __future__ import annotations


class RankLost(BaseException):
    """A collective failed (another rank died or hung up), or this rank's forward failed where its
    peers may wait in a collective. Not an Exception: no per-step guard keeps a rank serving apart
    from its peers; the process ends and the engine with it."""

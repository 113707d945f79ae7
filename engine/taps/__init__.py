"""Reading and steering the model's layers per request: hidden states, steering vectors, plugin taps
(docs/interpretability.md)."""

from engine.taps.plugin import LayerTap, TapRows
from engine.taps.spec import POINTS, TOKENS

__all__ = ["LayerTap", "POINTS", "TOKENS", "TapRows"]

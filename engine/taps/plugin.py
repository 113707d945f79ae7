"""What a plugin declares to tap layers (LayerTap) and what its function receives (TapRows)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from engine.taps.spec import POINTS

if TYPE_CHECKING:
    import torch


@dataclass
class TapRows:
    """One step's rows at one (layer, point) for the requests a tap serves. `values` [R, hidden] in
    the model's dtype; a tap with writes=True may change it in place and the engine writes it back."""

    layer: int
    point: str
    values: torch.Tensor
    rids: list[str]
    positions: list[int]  # each row's position in its request's sequence
    beams: list[int | None]  # a beam search's beam index, None for an ordinary request
    mode: str  # "prefill" or "decode"
    # the scheduler's model, read-only: model.logits(values, None) gives float32 logits (a logit lens)
    model: Any = None


@dataclass(frozen=True)
class LayerTap:
    """A plugin's tap: `fn(rows: TapRows)` runs in the scheduler during the forward pass, once per
    step per (layer, point), for the requests that list `name` in layer_taps (every request with
    every_request=True). writes=True: its requests neither read nor write the prefix cache."""

    name: str
    layers: tuple[int, ...]
    fn: Callable[[TapRows], None]
    points: tuple[str, ...] = ("resid_post",)
    writes: bool = False
    every_request: bool = False
    plugin: str = field(default="", compare=False)  # set by the registry: who declared it

    def problem(self, num_layers: int) -> str | None:
        """Why this tap cannot run on a model of num_layers layers, or None."""
        if not self.name or not isinstance(self.name, str):
            return "a LayerTap needs a name"
        bad = [p for p in self.points if p not in POINTS]
        if bad:
            return f"tap {self.name!r}: points {bad} are not among {list(POINTS)}"
        out = [i for i in self.layers if not -num_layers <= i < num_layers]
        if out or not self.layers:
            return f"tap {self.name!r}: layers must be in [-{num_layers}, {num_layers}), got {list(self.layers)}"
        return None

"""The layer taps and named steering vectors plugins provide, gathered through their hooks."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from engine import hooks
from engine.taps.plugin import LayerTap

logger = logging.getLogger(__name__)


class TapRegistry:
    """The plugins' taps (layers made non-negative) and vectors, read again when the plugins change."""

    def __init__(
        self, num_layers: int, hidden_size: int, device=None, dtype=None, model=None
    ) -> None:
        """device, dtype, model: the scheduler's model and where it runs (steering vectors are made
        there; taps see the model in TapRows.model)."""
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.device, self.dtype, self.model = device, dtype, model
        self._key: tuple | None = None
        self._taps: dict[str, LayerTap] = {}
        self.requested = False  # a request with taps or steering has arrived

    @property
    def active(self) -> bool:
        """Whether a step may need a tap plan at all: until then steps skip the tap stage."""
        return self.requested or bool(self.every_request())

    def taps(self) -> dict[str, LayerTap]:
        key = tuple(hooks.implementers("engine_layer_taps"))
        if key != self._key:
            self._key, self._taps = key, self._gather()
        return self._taps

    def every_request(self) -> list[LayerTap]:
        """The taps on every request's rows (asked each step: nothing to list without a plugin)."""
        if not hooks.has("engine_layer_taps"):
            return []
        return [t for t in self.taps().values() if t.every_request]

    def _gather(self) -> dict[str, LayerTap]:
        """A plugin whose hook fails or whose tap is malformed is logged and left out: it must not
        stop the engine."""
        found: dict[str, LayerTap] = {}
        for plugin, result, error in hooks.call_each(
            "engine_layer_taps", num_layers=self.num_layers
        ):
            if error is not None:
                logger.error("engine::taps: %s", error)
                continue
            for tap in result or ():
                problem = (
                    tap.problem(self.num_layers)
                    if isinstance(tap, LayerTap)
                    else f"{tap!r} is not an engine.taps.LayerTap"
                )
                if problem is None and tap.name in found:
                    problem = f"tap {tap.name!r} is declared twice"
                if problem is not None:
                    logger.error("engine::taps: plugin %r: %s", plugin, problem)
                    continue
                layers = tuple(sorted({i % self.num_layers for i in tap.layers}))
                found[tap.name] = dataclasses.replace(tap, layers=layers, plugin=plugin)
        return found

    def vector(self, name: str) -> list[float]:
        """The named steering vector as hidden_size floats; ValueError if none or malformed."""
        for plugin, result, error in hooks.call_each("engine_steering_vectors"):
            if error is not None:
                raise ValueError(str(error))
            if result and name in result:
                return checked_vector(
                    result[name], self.hidden_size, f"vector {name!r} of plugin {plugin!r}"
                )
        raise ValueError(f"no plugin registered a steering vector named {name!r}")


def checked_vector(values: Any, hidden_size: int, what: str) -> list[float]:
    """values as a list of hidden_size finite floats (a list or a 1-D tensor), else ValueError."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) for v in values
    ):
        raise ValueError(f"{what} must be a list of {hidden_size} numbers")
    if len(values) != hidden_size:
        raise ValueError(
            f"{what} has {len(values)} values; the model's hidden size is {hidden_size}"
        )
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{what} holds a value that is not finite")
    return [float(v) for v in values]

"""The layer fields of a call (hidden states, steering, plugin taps: engine/taps) as one LayerRequest,
checked against the model's layers and the bound on the hidden states one request may return."""

from __future__ import annotations

from engine.taps.checks import layer_request, size_problem
from engine.taps.registry import TapRegistry
from engine.taps.spec import LayerRequest


class LayerChecks:
    def __init__(self) -> None:
        self.taps = TapRegistry(0, 0)  # the model's layers and plugins' taps, known at start
        self.max_hidden_state_bytes = 0

    def configure(self, info: dict) -> None:
        """The model's facts, from the scheduler's ready message."""
        self.taps = TapRegistry(info["num_layers"], info["hidden_size"])
        self.max_hidden_state_bytes = info["max_hidden_state_bytes"]

    def layer_request(
        self, return_hidden_states, steering, layer_taps, id_lists, params, beam, is_batch
    ) -> LayerRequest | None:
        """The call's hidden states, steering and plugin taps (engine/taps), checked for every prompt."""
        layers = layer_request(return_hidden_states, steering, layer_taps, self.taps)
        hidden = layers.hidden if layers is not None else None
        if hidden is None:
            return layers
        for i, (ids, p) in enumerate(zip(id_lists, params)):
            where = f"request {i}: " if is_batch else ""
            problem = size_problem(
                layers,
                len(ids),
                p.max_new_tokens,
                self.taps.hidden_size,
                self.max_hidden_state_bytes,
                beam.num_return if beam is not None else 1,
                beam.width if beam is not None else 0,
            )
            if problem is not None:
                raise ValueError(where + problem)
        return layers

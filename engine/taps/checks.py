"""The per-request fields return_hidden_states, steering and layer_taps, checked in the user process
before anything is queued: a ValueError names the field."""

from __future__ import annotations

import array
import math
from typing import Any

from engine.taps.registry import TapRegistry, checked_vector
from engine.taps.spec import POINTS, TOKENS, HiddenSpec, LayerRequest, SteerSpec


def _layer(value: Any, num_layers: int, field: str) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not -num_layers <= value < num_layers
    ):
        raise ValueError(
            f"{field} must be a layer index in [-{num_layers}, {num_layers}) (the model has "
            f"{num_layers} layers), got {value!r}"
        )
    return value % num_layers


def hidden_spec(value: Any, num_layers: int) -> HiddenSpec | None:
    """return_hidden_states: None, True (the last layer, the prompt's last token) or a dict with
    layers, tokens and point."""
    if value is None or value is False:
        return None
    if value is True:
        return HiddenSpec((num_layers - 1,))
    if not isinstance(value, dict):
        raise ValueError(
            "return_hidden_states must be true or an object with layers, tokens, point"
        )
    unknown = sorted(set(value) - {"layers", "tokens", "point"})
    if unknown:
        raise ValueError(f"return_hidden_states has unknown fields {unknown}")
    layers = value.get("layers", [-1])
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("return_hidden_states.layers must be a non-empty list of layer indices")
    picked = [_layer(v, num_layers, "return_hidden_states.layers") for v in layers]
    if len(set(picked)) != len(picked):
        raise ValueError(f"return_hidden_states.layers names a layer twice: {list(layers)}")
    tokens = value.get("tokens", "last")
    if tokens not in TOKENS:
        raise ValueError(
            f"return_hidden_states.tokens must be one of {list(TOKENS)}, got {tokens!r}"
        )
    point = value.get("point", "resid_post")
    if point not in POINTS:
        raise ValueError(f"return_hidden_states.point must be one of {list(POINTS)}, got {point!r}")
    return HiddenSpec(tuple(picked), tokens, point)


def _floats(values: list[float]) -> bytes:
    return array.array("f", values).tobytes()


def steer_specs(value: Any, num_layers: int, registry: TapRegistry) -> tuple[SteerSpec, ...]:
    """steering: a list of {layer, vector (hidden_size numbers, or a registered name), scale}."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError("steering must be a list of {layer, vector, scale} objects")
    specs = []
    for i, item in enumerate(value):
        where = f"steering[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object with layer, vector and scale")
        unknown = sorted(set(item) - {"layer", "vector", "scale"})
        if unknown:
            raise ValueError(f"{where} has unknown fields {unknown}")
        if "layer" not in item or "vector" not in item:
            raise ValueError(f"{where} needs a layer and a vector")
        layer = _layer(item["layer"], num_layers, f"{where}.layer")
        scale = item.get("scale", 1.0)
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not math.isfinite(scale)
        ):
            raise ValueError(f"{where}.scale must be a finite number, got {scale!r}")
        vector = item["vector"]
        if isinstance(vector, str):
            try:
                registry.vector(vector)
            except ValueError as exc:
                raise ValueError(f"{where}.vector: {exc}") from None
            specs.append(SteerSpec(layer, name=vector, scale=float(scale)))
        else:
            floats = checked_vector(vector, registry.hidden_size, f"{where}.vector")
            specs.append(SteerSpec(layer, _floats(floats), scale=float(scale)))
    return tuple(specs)


def tap_names(value: Any, registry: TapRegistry) -> tuple[str, ...]:
    """layer_taps: names of plugin taps (LayerTap.name) the request asks for."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError("layer_taps must be a list of tap names")
    known = registry.taps()
    unknown = [v for v in value if v not in known]
    if unknown:
        raise ValueError(
            f"layer_taps names {unknown}, which no loaded plugin provides (known: {sorted(known)})"
        )
    return tuple(dict.fromkeys(value))


def layer_request(
    return_hidden_states: Any, steering: Any, layer_taps: Any, registry: TapRegistry
) -> LayerRequest | None:
    """The three fields as one LayerRequest, or None when none is asked for."""
    n = registry.num_layers
    spec = LayerRequest(
        hidden_spec(return_hidden_states, n),
        steer_specs(steering, n, registry),
        tap_names(layer_taps, registry),
    )
    return spec if spec.hidden or spec.steering or spec.taps else None


def size_problem(
    spec: LayerRequest | None,
    prompt_len: int,
    max_new_tokens: int,
    hidden_size: int,
    bound: int,
    hypotheses: int = 1,
    width: int = 0,
) -> str | None:
    """Why the hidden states this request may take are over the bound, or None. A beam search
    (`width` beams, `hypotheses` returned) holds each step's rows of its `width` beams while it runs,
    and at its end the returned hypotheses' rows besides: both count."""
    hidden = spec.hidden if spec is not None else None
    if hidden is None:
        return None
    generated = (width + hypotheses if width else hypotheses) * max_new_tokens
    rows = {"last": 1, "prompt": prompt_len, "generated": generated}.get(
        hidden.tokens, prompt_len + generated
    )
    size = len(hidden.layers) * rows * hidden_size * 4
    if size <= bound:
        return None
    held = ""
    if width and hidden.tokens in ("generated", "all"):
        held = (
            f"; a beam search holds beam_width {width} x max_new_tokens {max_new_tokens} rows "
            f"while it runs, then num_return_sequences {hypotheses} x {max_new_tokens} returned"
        )
    return (
        f"return_hidden_states may take {size} bytes ({len(hidden.layers)} layers x {rows} "
        f"rows x {hidden_size} x 4{held}), more than max_hidden_state_bytes={bound}"
    )

"""Wire types of layer taps: what a request asks of the layers, and the hidden states it gets back."""

from __future__ import annotations

from typing import Union

import msgspec

POINTS = ("resid_post", "attn_out", "mlp_out")  # where in a decoder layer a tap reads or writes
TOKENS = ("last", "prompt", "generated", "all")  # which rows return_hidden_states returns


class HiddenSpec(msgspec.Struct, array_like=True, frozen=True):
    """return_hidden_states, checked: layers are 0-based and non-negative."""

    layers: tuple[int, ...]
    tokens: str = "last"
    point: str = "resid_post"


class SteerSpec(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """Add scale * vector to the residual stream after `layer`: the vector inline (float32,
    little-endian) or the name a plugin registered it under."""

    layer: int
    vector: bytes = b""
    name: str = ""
    scale: float = 1.0


class LayerRequest(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """Everything one request asks of the model's layers."""

    hidden: Union[HiddenSpec, None] = None
    steering: tuple[SteerSpec, ...] = ()
    taps: tuple[str, ...] = ()  # plugin taps (LayerTap.name) this request asks for


class HiddenStates(msgspec.Struct, array_like=True, omit_defaults=True):
    """A finished request's hidden states: float32, little-endian, [len(layers), rows, hidden]."""

    layers: list[int]
    point: str
    hidden_size: int
    prompt: bytes = b""  # "last": the last prompt token's row; "prompt", "all": every prompt token
    prompt_rows: int = 0
    generated: bytes = b""  # row k: the state at the position that predicted generated token k
    generated_rows: int = 0
    # a beam search: `generated` holds its returned hypotheses' rows one after another, best first
    beam_rows: list[int] = []  # each hypothesis's rows

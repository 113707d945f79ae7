"""Hidden states over HTTP: the engine's float32 tensors as JSON (docs/server.md, "Hidden states").

Each tensor becomes {"shape": [...], "dtype": "float32", "byteorder": "little", "data": base64 of
its raw bytes, row-major}: exact, and a third larger than the bytes, where JSON numbers would be
about three times. "layers" and "point" stay as the engine gives them. decode_hidden_states turns
the object back into tensors; it needs only base64, numpy and torch, so a client may copy it.
"""

from __future__ import annotations

import base64
from typing import Any

TENSOR_KEYS = ("prompt", "generated")


def encode_tensor(tensor: Any) -> dict[str, Any]:
    """A float32 tensor (torch or numpy) as {"shape", "dtype", "byteorder", "data"}."""
    import numpy as np

    array = tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)
    little = np.ascontiguousarray(array, dtype="<f4")
    return {
        "shape": list(little.shape),
        "dtype": "float32",
        "byteorder": "little",
        "data": base64.b64encode(little.tobytes()).decode("ascii"),
    }


def encode_hidden_states(states: dict[str, Any]) -> dict[str, Any]:
    """The engine's meta_info["hidden_states"] with each tensor encoded (other keys as they are; a
    beam search's "generated", a list of tensors, as a list)."""
    return {k: _encode(v) if k in TENSOR_KEYS else v for k, v in states.items()}


def _encode(value: Any) -> Any:
    return [encode_tensor(t) for t in value] if isinstance(value, list) else encode_tensor(value)


def encode_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """meta_info as JSON can carry it: a copy with its hidden states encoded, or meta itself."""
    states = meta.get("hidden_states")
    if states is None:
        return meta
    return {**meta, "hidden_states": encode_hidden_states(states)}


def encode_result(result: Any) -> Any:
    """A /generate answer (one result or a list of them) with its hidden states encoded."""
    if isinstance(result, list):
        return [encode_result(r) for r in result]
    if isinstance(result, dict) and isinstance(result.get("meta_info"), dict):
        return {**result, "meta_info": encode_meta(result["meta_info"])}
    return result


def decode_tensor(obj: dict[str, Any]) -> Any:
    """One encoded tensor back as a torch float32 tensor."""
    import numpy as np
    import torch

    if obj.get("dtype") != "float32":
        raise ValueError(f"unsupported dtype {obj.get('dtype')!r}, expected 'float32'")
    order = {"little": "<", "big": ">"}[obj.get("byteorder", "little")]
    array = np.frombuffer(base64.b64decode(obj["data"]), dtype=order + "f4")
    return torch.from_numpy(array.astype("=f4").reshape(obj["shape"]))


def decode_hidden_states(obj: dict[str, Any]) -> dict[str, Any]:
    """An answer's "hidden_states" object as the engine returns it in-process: "prompt" and
    "generated" (those present) as torch float32 tensors [layers, rows, hidden], "layers" and
    "point" as they are."""
    return {k: _decode(v) if k in TENSOR_KEYS else v for k, v in obj.items()}


def _decode(value: Any) -> Any:
    return [decode_tensor(t) for t in value] if isinstance(value, list) else decode_tensor(value)


def choice_fields(meta: dict[str, Any], hypothesis: int | None = None) -> dict[str, Any]:
    """What an OpenAI choice carries beside OpenAI's fields: {"hidden_states": ...} when the
    result has them, else nothing. A beam search's choice (`hypothesis`, its index among the
    hypotheses) carries the prompt's rows and that hypothesis's own generated rows."""
    states = meta.get("hidden_states")
    if states is None:
        return {}
    generated = states.get("generated")
    if hypothesis is not None and isinstance(generated, list):
        states = {**states, "generated": generated[hypothesis]}
    return {"hidden_states": encode_hidden_states(states)}

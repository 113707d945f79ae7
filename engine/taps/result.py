"""A finished request's hidden states as the caller sees them: float32 tensors [layers, rows, hidden]."""

from __future__ import annotations

from typing import Any

from engine.taps.spec import HiddenStates


def hidden_states_dict(hs: HiddenStates) -> dict[str, Any]:
    """{"layers", "point", "prompt" and/or "generated"}: torch is imported only by a request that
    asked for hidden states. A beam search's "generated" is a list: one tensor per hypothesis."""
    import torch

    out: dict[str, Any] = {"layers": list(hs.layers), "point": hs.point}
    for name, data, rows in (
        ("prompt", hs.prompt, hs.prompt_rows),
        ("generated", hs.generated, hs.generated_rows),
    ):
        if data or rows:
            t = torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.zeros(0)
            out[name] = t.reshape(len(hs.layers), rows, hs.hidden_size)
    if hs.beam_rows:
        out["generated"] = list(out["generated"].split(hs.beam_rows, dim=1))
    return out

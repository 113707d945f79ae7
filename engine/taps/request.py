"""One request's taps inside the scheduler: its steering vectors, the plugin taps it asked for, and
the hidden states captured so far (each position once, even when a retraction recomputes it).
Vectors and states travel as float32 in the host's byte order: little-endian on every supported host."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.taps.plugin import LayerTap
from engine.taps.spec import POINTS, HiddenStates, LayerRequest

if TYPE_CHECKING:
    from engine.taps.registry import TapRegistry


class RequestTaps:
    __slots__ = (
        "hidden",
        "steer",
        "taps",
        "private_kv",
        "prompt_len",
        "hidden_size",
        "start",
        "next_pos",
        "end_pos",
        "chunks",
        "beam_step",
    )

    def __init__(
        self,
        spec: LayerRequest,
        prompt_len: int,
        max_new_tokens: int,
        registry: TapRegistry,
    ) -> None:
        """ValueError when a named vector or tap is unknown here (the user process checked it too)."""
        n = registry.num_layers
        bad = [i for i in (spec.hidden.layers if spec.hidden else ()) if not 0 <= i < n]
        bad += [s.layer for s in spec.steering if not 0 <= s.layer < n]
        if bad or (spec.hidden is not None and spec.hidden.point not in POINTS):
            raise ValueError(f"layers {bad} or a point the model does not have ({n} layers)")
        self.hidden = spec.hidden
        self.prompt_len = prompt_len
        self.hidden_size = registry.hidden_size
        steer: dict[int, torch.Tensor] = {}
        for s in spec.steering:
            if s.name:
                v = torch.tensor(registry.vector(s.name), dtype=torch.float32)
            else:
                v = torch.frombuffer(bytearray(s.vector), dtype=torch.float32)
                if v.numel() != registry.hidden_size:
                    raise ValueError(
                        f"a steering vector has {v.numel()} values, not {registry.hidden_size}"
                    )
            steer[s.layer] = steer.get(s.layer, 0) + s.scale * v
        # [hidden] per layer, summed over the request's vectors at that layer, in the model's dtype
        self.steer = {i: v.to(registry.device, registry.dtype) for i, v in steer.items()}
        known = registry.taps()
        missing = [n for n in spec.taps if n not in known]
        if missing:
            raise ValueError(f"layer_taps names {missing}, which no plugin here provides")
        self.taps: tuple[LayerTap, ...] = tuple(known[n] for n in spec.taps)
        # its K/V differ from an untouched request's from the first changed layer on
        self.private_kv = bool(self.steer) or any(t.writes for t in self.taps)
        # the positions whose rows return_hidden_states wants: [start, end_pos)
        tokens = self.hidden.tokens if self.hidden is not None else None
        self.start = 0 if tokens in ("prompt", "all") else prompt_len - 1
        if tokens is None:
            self.end_pos = 0
        elif tokens in ("last", "prompt"):
            self.end_pos = prompt_len
        else:  # the position that predicts the last of max_new_tokens
            self.end_pos = prompt_len - 1 + max_new_tokens
        self.next_pos = self.start
        # [len(layers), rows, hidden] float32, in position order
        self.chunks: list[torch.Tensor] = []
        # a beam search's rows of its latest decode step, [layers, K, hidden], till its selection
        self.beam_step: list[torch.Tensor] = []

    def prefix_limit(self) -> int | None:
        """The most fill tokens the prefix cache may lend: none to a request whose K/V are its own,
        and none past the first position whose hidden state is still wanted (a cached prefix has no
        activations). None: no limit."""
        if self.private_kv:
            return 0
        return self.next_pos if self.next_pos < self.end_pos else None

    def wanted(self, first: int, count: int) -> tuple[int, int] | None:
        """Of the positions [first, first + count) computed now, the ones to capture: [a, b), taken."""
        a, b = max(first, self.next_pos), min(first + count, self.end_pos)
        if b <= a:
            return None
        self.next_pos = b
        return a, b

    def result(self, generated: int) -> HiddenStates | None:
        """The captured rows as the wire message; `generated`: the tokens the request produced."""
        spec = self.hidden
        if spec is None:
            return None
        hidden_size = self.hidden_size
        if self.chunks:
            rows = torch.cat(self.chunks, dim=1)
        else:
            rows = torch.zeros(len(spec.layers), 0, hidden_size)
        out = HiddenStates(list(spec.layers), spec.point, hidden_size)
        p = self.prompt_len
        if spec.tokens in (
            "last",
            "prompt",
            "all",
        ):  # rows start at position 0, or p - 1 for "last"
            out.prompt_rows, out.prompt = _part(rows, 0, 1 if spec.tokens == "last" else p)
        if spec.tokens in ("generated", "all"):  # row k: the position p - 1 + k
            first = 0 if spec.tokens == "generated" else p - 1
            out.generated_rows, out.generated = _part(rows, first, first + generated)
        return out


def _part(rows: torch.Tensor, a: int, b: int) -> tuple[int, bytes]:
    """Rows [a, b) of [layers, rows, hidden] (fewer if fewer were computed) as float32 bytes."""
    part = rows[:, a:b].float().contiguous()
    return part.shape[1], part.numpy().tobytes()

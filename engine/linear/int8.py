"""int8 weights, one float32 scale per output channel; activations stay float32 (weight-only).

Why weight-only: torch's fbgemm dynamic int8 linear also quantizes the activations, per tensor, and
SmolLM2's MLP activations have outlier channels that cost it most of its perplexity; weight-only int8
loses almost nothing (docs/quantization.md). Its kernel is ours (engine/kernels/cpu/int8_linear.c).

Layers whose output width is a multiple of 16 (all of SmolLM2's) keep their weights in panels of 16 output
rows ([N / 16, K, 16], panels()), which int8_panel_linear multiplies at any row count where it is built with
AVX2 and FMA (elsewhere its scalar loop takes up to DIRECT_MAX_ROWS rows, dequantized tiles the rest).
Other layers keep the row-major kernel up to DIRECT_MAX_ROWS rows, and for more rows multiply float32
weights dequantized for the call (in tiles, engine/linear/quantized.py).
"""

from __future__ import annotations

import sys

import torch

from engine.linear.quantized import QuantizedLinear

# row-major layers, and panels on a build without AVX2: more rows multiply dequantized tiles
DIRECT_MAX_ROWS = 64
PANEL = 16  # output rows a panel (int8_linear.c's PANEL)


def in_panels(out_features: int) -> bool:
    """Whether a layer of this output width keeps its weights in panels (int8_panel_linear)."""
    return out_features % PANEL == 0


def stored_shape(out_features: int, in_features: int) -> tuple[int, ...]:
    """The shape of a layer's int8 weights as the layer (and the on-disk cache) holds them."""
    if in_panels(out_features):
        return (out_features // PANEL, in_features, PANEL)
    return (out_features, in_features)


def panels(q: torch.Tensor) -> torch.Tensor:
    """Row-major int8 [N, K] (N a multiple of 16) as panels [N / 16, K, 16]: panel p, k, j is q[16 p + j, k]."""
    n, k = q.shape
    return q.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def rows_of(stored: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The row-major [N, K] view (or copy, from panels) of a layer's stored int8 weights."""
    if stored.dim() == 3:
        return stored.transpose(1, 2).reshape(out_features, in_features)
    return stored


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 [N, K], float32 scale [N]) with weight ~= int8 * scale[:, None]."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def as_stored(q: torch.Tensor) -> torch.Tensor:
    """Row-major int8 [N, K] in the layout the layer and the cache hold (stored_shape)."""
    return panels(q) if in_panels(q.shape[0]) else q.contiguous()


def quantize_stored(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows, its int8 weights as stored."""
    q, scale = quantize_rows(weight)
    return as_stored(q), scale


class Int8Linear(QuantizedLinear):
    """A frozen linear layer holding only int8 weights and their per-row scales."""

    kind_name, direct_max_rows = "int8", DIRECT_MAX_ROWS

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lib,
        threads: int,
        known: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """known: (int8 weight, scales) quantized before from this same weight (the on-disk cache)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.in_panels = in_panels(self.out_features)
        vectorized = lib is not None and self.in_panels and lib.int8_panel_vectorized() == 1
        # else: the scalar loop, few rows
        self.direct_max_rows = sys.maxsize if vectorized else DIRECT_MAX_ROWS
        shape = stored_shape(self.out_features, self.in_features)
        # the kernel reads them raw
        ok = (
            known is not None
            and known[0].dtype == torch.int8
            and known[1].dtype == torch.float32
            and tuple(known[0].shape) == shape
            and known[1].shape == (self.out_features,)
            and known[0].is_contiguous()
            and known[1].is_contiguous()
        )
        if not ok and weight.is_meta:
            raise ValueError(
                "int8 weights given for this layer do not fit it, and its float weight was not loaded"
            )
        if ok:
            qweight, scale = known
        else:
            qweight, scale = quantize_stored(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.float32).contiguous()
        )
        self._lib, self._threads = lib, threads

    def _dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        if self.in_panels:  # the panels that hold rows r0..r1
            p0, p1 = r0 // PANEL, -(-r1 // PANEL)
            rows = rows_of(self.qweight[p0:p1], (p1 - p0) * PANEL, self.in_features)
            q = rows[r0 - p0 * PANEL : r1 - p0 * PANEL]
        else:
            q = self.qweight[r0:r1]
        out.copy_(q).mul_(self.scale[r0:r1, None])

    def _kernel_args(self):
        bias = None if self.bias is None else self.bias.data_ptr()
        fn = self._lib.int8_panel_linear if self.in_panels else self._lib.int8_linear
        return fn, (), (self.qweight.data_ptr(), self.scale.data_ptr(), bias)

    def decode_linear(self) -> dict:
        """The layer as engine/model/decode_layers.py hands it to the C step (the addresses _kernel_args passes)."""
        bias = None if self.bias is None else self.bias.data_ptr()
        return {
            "kind": "int8",
            "arg": int(self.in_panels),
            "threads": self._threads,
            "w": self.qweight.data_ptr(),
            "scale": self.scale.data_ptr(),
            "bias": bias,
        }

    def extra_repr(self) -> str:
        layout = "in panels of 16 rows" if self.in_panels else "row-major"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 weights {layout}, "
            "per-row scales"
        )

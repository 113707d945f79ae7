"""What the quantized linear layers share: frozen float32-in, float32-out layers whose calls of up to
direct_max_rows rows go to a C kernel reading the quantized weights and whose calls of more rows multiply
dequantized tiles (int8 layers in panels take every row count to their kernel: engine/linear/int8.py).

The dequantized tiles are written into one scratch buffer that every layer shares (the scheduler runs
one forward at a time): a fresh allocation per layer and step would be fresh pages for the kernel
to fault in and zero. Tiles are of at most SCRATCH_MAX_ELEMENTS weights, so the buffer stays small
whatever the layer (a large lm_head takes several tiles).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

SCRATCH_MAX_ELEMENTS = 1 << 22  # 16 MB of float32: every layer of SmolLM2-135M but lm_head
_scratch = torch.empty(0, dtype=torch.float32)


def _scratch_weight(n: int, k: int) -> torch.Tensor:
    global _scratch
    if _scratch.numel() < n * k:
        _scratch = torch.empty(n * k, dtype=torch.float32)
    return _scratch[: n * k].view(n, k)


class QuantizedLinear(nn.Module):
    """Subclasses set kind_name, direct_max_rows, in/out_features, bias and _threads, and implement
    _kernel_args and _dequantize_into; _activations and _correct change what the tiles multiply (gguf
    rounds x)."""

    kind_name = "quantized"
    direct_max_rows = 64
    _bound: Callable[[int, int, int], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            raise TypeError(f"{self.kind_name} layers take float32 activations, got {rows.dtype}")
        m = rows.shape[0]
        if m > self.direct_max_rows:
            out = self._dequantized_matmul(rows)
        else:
            rows = rows.contiguous()
            out = torch.empty(m, self.out_features, dtype=torch.float32)
            if m:
                self._direct(rows, out)
        # contiguous: engine/model/fused_decode.py relies on it
        return out.reshape(*x.shape[:-1], self.out_features)

    def _direct(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out [m, out_features] = the layer on rows [m, in_features] (contiguous, 0 < m <= direct_max_rows)."""
        self.kernel_call()(rows.data_ptr(), out.data_ptr(), rows.shape[0])

    def kernel_call(self) -> Callable[[int, int, int], None]:
        """f(x_ptr, y_ptr, m): the direct kernel on m contiguous float32 rows at x_ptr into y_ptr, with the
        weights' addresses bound once. Why: a decode step makes 121 such calls, and looking up buffers and
        their data pointers again each time was a tenth of a step at batch 1 (engine/model/fused_decode.py
        calls these directly); checking them again each call, 3% of a step. Rebound after any buffer is
        replaced (assigned, registered, or moved by .to() and the like, which go through _apply); not after
        a buffer's storage is swapped under it (`buf.data = t`, `set_()`, writing `_buffers` directly) or a
        deepcopy, none of which the engine does."""
        if self._bound is not None:
            return self._bound
        fn, before, after = self._kernel_args()
        n, k, threads, name = self.out_features, self.in_features, self._threads, fn.__name__

        def call(x: int, y: int, m: int) -> None:
            rc = fn(*before, x, *after, y, m, n, k, threads)
            if rc != 0:
                raise RuntimeError(f"{name} failed with code {rc}")

        object.__setattr__(self, "_bound", call)
        return call

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, "_bound", None)
        super().__setattr__(name, value)

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        object.__setattr__(self, "_bound", None)
        super().register_buffer(name, tensor, persistent)

    def _apply(self, fn, recurse: bool = True):
        object.__setattr__(self, "_bound", None)
        return super()._apply(fn, recurse)

    def _kernel_args(self) -> tuple[Callable, tuple, tuple]:
        """The kernel, and what it takes before x and between x and y (weights, scales, bias addresses,
        as they are now); it then takes y, m, out_features, in_features, threads, and returns 0 or a code."""
        raise NotImplementedError

    def _dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        """Output rows r0..r1 of the weight, in float32, into out [r1 - r0, in_features]."""
        raise NotImplementedError

    def _activations(self, rows: torch.Tensor) -> tuple[torch.Tensor, object]:
        """What the dequantized tiles multiply, and what _correct needs: rows as they are, by default."""
        return rows, None

    def _correct(self, part: torch.Tensor, r0: int, r1: int, context: object) -> None:
        """Adjust one tile's output in place (nothing, by default)."""

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer multiplies by, in float32."""
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        self._dequantize_into(0, self.out_features, out)
        return out

    @torch.inference_mode()  # the shared scratch buffer is an inference tensor (the direct path needs no mode:
    # entering one costs microseconds, and a decode step calls 121 layers)
    def _dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """Many input rows: float32 GEMMs over tiles of output rows, each dequantized into the scratch buffer."""
        n, k = self.out_features, self.in_features
        x, context = self._activations(rows)
        tile = max(1, min(n, SCRATCH_MAX_ELEMENTS // k))
        out = None if tile == n else torch.empty(rows.shape[0], n, dtype=torch.float32)
        for r0 in range(0, n, tile):
            r1 = min(n, r0 + tile)
            weight = _scratch_weight(r1 - r0, k)
            self._dequantize_into(r0, r1, weight)
            part = torch.nn.functional.linear(
                x, weight, None if self.bias is None else self.bias[r0:r1]
            )
            self._correct(part, r0, r1, context)
            if out is None:
                return part
            out[:, r0:r1] = part
        return out

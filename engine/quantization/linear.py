"""What the quantized linear layers share: frozen float32-in, float32-out layers whose few-row calls go
to a C kernel reading the quantized weights and whose many-row calls multiply dequantized tiles."""

from __future__ import annotations

import torch
from torch import nn


class QuantizedLinear(nn.Module):
    """Subclasses set kind_name, direct_max_rows, in/out_features, and implement _direct and _dequantized_matmul."""

    kind_name = "quantized"
    direct_max_rows = 64

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
        return out.reshape(*x.shape[:-1], self.out_features)

    def _direct(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out [m, out_features] = the layer on rows [m, in_features] (contiguous, 0 < m <= direct_max_rows)."""
        raise NotImplementedError

    def _dequantized_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

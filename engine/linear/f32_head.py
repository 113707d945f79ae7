"""A bfloat16 model's lm_head computed in float32: float32 rows in, float32 logits out, bfloat16 weights.

Rounded to bfloat16, logits near the top are 0.125 apart, so close candidates tie and greedy picks by
token id; here they are never rounded. On AVX-512 CPUs our kernel (engine/kernels/cpu/bf16_logits.c)
widens the packed weights in registers; elsewhere the weights are widened a slice at a time for torch.
"""

from __future__ import annotations

import torch
from torch import nn

SLICE_ROWS = 4096  # vocabulary rows widened at a time on the torch path


def panel_columns(out_features: int) -> int:
    """nr, the 16-column groups of one panel of the kernel, or 0 when the width is not a multiple of 16."""
    for nr in (3, 2, 1):
        if out_features % (16 * nr) == 0:
            return nr
    return 0


class Float32Head(nn.Module):
    """y = x W^T in float32 for float32 x and bfloat16 W [vocab, hidden] (no bias: an lm_head)."""

    def __init__(self, linear: nn.Linear, lib=None) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Float32Head takes an lm_head without bias")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.nr = panel_columns(self.out_features)
        usable = lib is not None and hasattr(lib, "bf16_logits") and lib.bf16_logits_support() == 1
        if usable and self.nr and weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            weight = weight.contiguous()
            self.packed = torch.empty(self.out_features * self.in_features, dtype=torch.int16)
            if lib.bf16_logits_pack(
                weight.data_ptr(),
                self.out_features,
                self.in_features,
                self.nr,
                self.packed.data_ptr(),
            ):
                raise ValueError(
                    f"bf16_logits cannot pack a {self.out_features} x {self.in_features} weight"
                )
            self.weight, self._lib = None, lib
        else:  # shared with a tied embedding where it is one: no copy
            self.packed, self.weight, self._lib = None, weight, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, in] float32 -> [m, out] float32
        x = x.float().reshape(-1, self.in_features).contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        if self._lib is not None:
            if self._lib.bf16_logits(
                x.data_ptr(),
                x.shape[0],
                self.in_features,
                self.packed.data_ptr(),
                self.out_features,
                self.nr,
                out.data_ptr(),
                torch.get_num_threads(),
            ):
                raise RuntimeError("bf16_logits refused a shape it packed")
            return out
        for start in range(0, self.out_features, SLICE_ROWS):
            out[:, start : start + SLICE_ROWS] = (
                x @ self.weight[start : start + SLICE_ROWS].float().t()
            )
        return out

    def extra_repr(self) -> str:
        kernel = "bf16_logits" if self._lib is not None else "torch"
        return f"in_features={self.in_features}, out_features={self.out_features}, float32 logits, {kernel}"

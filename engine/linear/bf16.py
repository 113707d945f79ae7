"""bfloat16 linear layers on our own kernel (engine/kernels/cpu/bf16_linear.c) where the CPU has
AVX512_BF16 and no AMX, in place of oneDNN's packed linear (the choice table's bf16-kernel row).

Why: where every layer's weights stream from memory (decode steps), oneDNN's bf16 kernel waits on them;
this one keeps the panels in the order it reads them (docs/performance.md has the figures). The same
instruction (vdpbf16ps), float32 sums and one rounding to bfloat16: values differ from oneDNN's only by
the order of the sums. CPUs with AMX keep oneDNN, whose tile instructions this kernel does not use.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.kernels.cpu.build import cpu_flags


def panel_columns(out_features: int) -> int:
    """nr, the 16-column groups of one panel (3 where it divides: 24 accumulators of the 32 registers),
    or 0 when the layer's width is not a multiple of 16."""
    for nr in (3, 2, 1):
        if out_features % (16 * nr) == 0:
            return nr
    return 0


def runs_here(lib) -> bool:
    """Whether the library runs bf16_linear on this CPU: built with AVX512_BF16 and without AMX, asked of
    /proc/cpuinfo too (a compiler too old to know AMX would build it for an AMX CPU). Asked once a load."""
    return lib is not None and lib.bf16_linear_support() == 1 and "amx_bf16" not in cpu_flags()


def fits(linear: nn.Linear) -> bool:
    """Whether the layer's shape is one the kernel takes: bfloat16, no bias, an even input width, an output
    width of a multiple of 16 (every SmolLM2 and Llama layer)."""
    return (
        linear.weight.dtype == torch.bfloat16
        and linear.bias is None
        and linear.in_features % 2 == 0
        and panel_columns(linear.out_features) > 0
    )


class Bf16Linear(nn.Module):
    """y = x W^T with W packed once into the kernel's panels (int32 pairs: only ever multiplied)."""

    def __init__(self, linear: nn.Linear, lib) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.nr = panel_columns(self.out_features)
        weight = linear.weight.detach().contiguous()
        self.packed = torch.empty(self.out_features * self.in_features // 2, dtype=torch.int32)
        if lib.bf16_linear_pack(
            weight.data_ptr(), self.out_features, self.in_features, self.nr, self.packed.data_ptr()
        ):
            raise ValueError(
                f"bf16_linear cannot pack a {self.out_features} x {self.in_features} weight"
            )
        self._lib = lib
        self._bound: Callable[[int, int, int], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise TypeError(f"Bf16Linear takes bfloat16 CPU rows, got {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.bfloat16)
        self.kernel_call()(rows.data_ptr(), out.data_ptr(), rows.shape[0])
        return out.view(*x.shape[:-1], self.out_features)

    def kernel_call(self) -> Callable[[int, int, int], None]:
        """f(x_ptr, y_ptr, m): the kernel on m contiguous bfloat16 rows at x_ptr into y_ptr, the packed weights'
        address bound (engine/model/fused_decode.py calls it directly, as QuantizedLinear.kernel_call). The
        packed tensor is made once, here, and never replaced."""
        if self._bound is None:
            lib, k, packed, n, nr = (
                self._lib,
                self.in_features,
                self.packed.data_ptr(),
                self.out_features,
                self.nr,
            )

            def call(x: int, y: int, m: int) -> None:
                if lib.bf16_linear(x, m, k, packed, n, nr, y, torch.get_num_threads()):
                    raise RuntimeError("bf16_linear refused a shape it packed")

            self._bound = call
        return self._bound

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False, bf16_linear"

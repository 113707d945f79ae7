"""float32 linear layers on our own kernel (engine/kernels/cpu/f32_linear.c) on CPUs with AVX2 and no
AVX-512, in place of oneDNN's packed linear and MKL (the choice table's f32-panels row).

Why: a decode step at one row streams every weight once, and this kernel reads them faster than
oneDNN's packed float32 one there (docs/performance.md). Each output is one FMA chain over the input in
order, so a row's output is bitwise the same alone or in any batch, which oneDNN's kernel (its blocking
depends on the row count) does not promise. The same weights and math as any float32 BLAS, only the
summation order differs: float32 greedy parity with transformers is tested (tests/test_parity_smollm2.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

PANEL = 16  # output columns a panel (f32_linear.c's NB)


def runs_here(lib) -> bool:
    """Whether the library runs f32_linear on this CPU (built with AVX2 and FMA)."""
    return lib is not None and hasattr(lib, "f32_linear") and lib.f32_linear_support() == 1


def fits(linear: nn.Linear) -> bool:
    """Whether the layer's shape is one the kernel takes: float32, no bias, an output width of a multiple
    of 16 (every SmolLM2 and Llama layer; biased ones, as Qwen2's qkv, keep oneDNN)."""
    return (
        linear.weight.dtype == torch.float32
        and linear.bias is None
        and linear.out_features % PANEL == 0
    )


class KernelLinear(nn.Module):
    """A frozen float32 linear layer run by one of our kernels: forward on kernel_call() -> f(x_ptr, y_ptr, m),
    which each subclass defines, bound to its weights (F32Linear's panels, f32_blocks.F32BlockLinear's blocks)."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(
                f"{type(self).__name__} takes float32 CPU rows, got {x.dtype} on {x.device}"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} takes {self.in_features} inputs a row, got {x.shape[-1]}"
            )
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        self.kernel_call()(rows.data_ptr(), out.data_ptr(), rows.shape[0])
        return out.view(*x.shape[:-1], self.out_features)


class F32Linear(KernelLinear):
    """y = x W^T with W packed once into the kernel's panels of 16 columns (only ever multiplied)."""

    def __init__(self, linear: nn.Linear, lib, packed: torch.Tensor | None = None) -> None:
        """packed: this weight's panels packed before (engine/linear/panel_cache.py maps them from disk); the
        linear's weight is then not read (it may be on the meta device)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if packed is not None:
            if (
                packed.dtype != torch.float32
                or packed.shape != (self.out_features * self.in_features,)
                or not packed.is_contiguous()
            ):
                raise ValueError(
                    f"packed panels of {tuple(packed.shape)} {packed.dtype} do not fit a "
                    f"{self.out_features} x {self.in_features} float32 layer"
                )
            self.packed = packed
        else:
            weight = linear.weight.detach().contiguous()
            self.packed = torch.empty(self.out_features * self.in_features, dtype=torch.float32)
            if lib.f32_linear_pack(
                weight.data_ptr(),
                self.out_features,
                self.in_features,
                self.packed.data_ptr(),
                torch.get_num_threads(),
            ):
                raise ValueError(
                    f"f32_linear cannot pack a {self.out_features} x {self.in_features} weight"
                )
        self._lib = lib
        self._bound: Callable[[int, int, int], None] | None = None

    def kernel_call(self) -> Callable[[int, int, int], None]:
        """f(x_ptr, y_ptr, m): the kernel on m contiguous float32 rows at x_ptr into y_ptr, the packed weights'
        address bound (as Bf16Linear.kernel_call). The packed tensor is made once, here, and never replaced."""
        if self._bound is None:
            lib, k, packed, n = (
                self._lib,
                self.in_features,
                self.packed.data_ptr(),
                self.out_features,
            )

            def call(x: int, y: int, m: int) -> None:
                if lib.f32_linear(x, m, k, packed, n, y, torch.get_num_threads()):
                    raise RuntimeError("f32_linear refused a shape it packed")

            self._bound = call
        return self._bound

    def decode_linear(self) -> dict:
        """The layer as engine/model/decode_layers.py hands it to the C step (the packed panels' address)."""
        return {"kind": "f32", "threads": torch.get_num_threads(), "w": self.packed.data_ptr()}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False, f32_linear"

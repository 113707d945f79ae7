"""What every linear layer is: y = x W^T (+ b) for rows x [..., in_features] -> [..., out_features].

An implementation is made once, at load, from what its weight format needs (engine/linear/build.py):
the float weight [out, in] (torch, oneDNN, bf16, f32 panels, int8 quantized from it), or what replaces
it (GGUF blocks, cached panels, stored int8 weights); choose.py's table says which, per layer.
Tensor parallelism hands each rank's layer a shard of those weights, by output rows or by input columns
in whole quantization blocks (engine/distributed/shard.py), and parallel.py sums or gathers the ranks'
outputs; room left, not built: a GPU implementation is one more file and one more table row.
Reading or changing the residual stream between layers is the model's (llama.py's DecoderLayer), never
a layer's.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class LinearLayer(Protocol):
    """A frozen linear layer: its sizes and its product (an nn.Module's __call__ runs forward)."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class DirectKernel(Protocol):
    """A layer whose kernel fused_decode.py may call by address: f(x_ptr, y_ptr, rows) on contiguous
    rows of the step's dtype, the weights bound once (Bf16Linear, F32Linear, F32BlockLinear, the
    quantized layers). decode_linear() (float32 ones) describes it to decode_layers.c."""

    def kernel_call(self) -> Callable[[int, int, int], None]: ...

"""torch's oneDNN linear with the weights reordered once, at load, into its blocked layout.

Given plain [out, in] weights, oneDNN rearranges them into that layout inside every call; reordered once
(torch.ops.mkldnn._reorder_linear_weight, as torch's compiler does for frozen linears), each call reads
them as they lie. The same weights and math; only the summation order inside the kernel differs from
torch's plain linear, as between any two BLAS kernels (greedy parity with transformers is tested).
"""

from __future__ import annotations


import torch
from torch import nn


BATCH_HINT = 64  # the row count oneDNN chooses the layout for (1-2,048 rows alike)
# torch capabilities where float32 weights leave plain torch at load
FLOAT32_ON = (
    "AVX2",
    "AVX512",
)


def packing_available(dtype: torch.dtype, device: str) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear in this dtype (float32 or bfloat16, the
    latter only where the CPU computes it natively)."""
    if dtype not in (torch.float32, torch.bfloat16) or torch.device(device).type != "cpu":
        return False
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    ops = torch.ops.mkldnn
    if not all(
        hasattr(ops, op)
        for op in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
    ):
        return False
    if dtype == torch.float32:  # the choice table says which layers (engine/linear/choose.py)
        return torch.backends.cpu.get_cpu_capability() in FLOAT32_ON
    return bool(ops._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's layout (an opaque mkldnn tensor: it is only ever multiplied)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(
        self, x: torch.Tensor
    ) -> torch.Tensor:  # [..., in] -> [..., out]: the op keeps leading dims
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"

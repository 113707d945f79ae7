"""bfloat16 linear layers on the CPU with their weights reordered once, at load, into oneDNN's blocked layout.

Why: given plain [out, in] weights, torch's bf16 matmul on the CPU (oneDNN's brgemm, AMX or AVX512_BF16)
rearranges them into its blocked layout (row pairs for the bf16 dot products) inside every call, for
every layer of every step. Reordered once (torch.ops.mkldnn._reorder_linear_weight, the packing torch's
own compiler applies to frozen bf16 linears), each call reads them as they lie: on an Intel Xeon with
AMX, 30 layers' matmuls at 64 rows went 25.8 -> 18.2 ms, at one row 18.7 -> 12.6 ms, prefill shapes
alike. float32 keeps nn.Linear: its greedy output is held token-identical to transformers', and another
kernel would round differently. The same weights, the same math; only the summation order inside
oneDNN may differ, as between any two of its kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import envvars
from engine.model.swap import release_freed_memory, replace_linears

BATCH_HINT = 64  # the row count oneDNN chooses the layout for; 64 and 512 measured alike at 1-2,048 rows


def packing_available(dtype: torch.dtype, device: str) -> bool:
    """Whether this torch build and CPU run oneDNN's packed bf16 linear (and ENGINE_PACK_WEIGHTS allows it)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or envvars.read("ENGINE_PACK_WEIGHTS") == "0":
        return False
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    ops = torch.ops.mkldnn
    return all(hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")) \
        and bool(ops._is_mkldnn_bf16_supported())  # fmt: skip


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's layout (an opaque mkldnn tensor: it is only ever multiplied)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]: the op keeps leading dims
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(model: nn.Module, dtype: torch.dtype, device: str) -> int:
    """Every nn.Linear of the model swapped in place for a PackedLinear where packing_available; the count.
    A tied lm_head gets its own packed copy (the embedding is gathered from, row by row, and stays plain):
    vocab x hidden more memory (57 MB for SmolLM2-135M) for a 1.5x faster logits matmul."""
    if not packing_available(dtype, device):
        return 0
    count = replace_linears(model, lambda _name, linear: PackedLinear(linear))
    release_freed_memory()  # the plain weights are garbage now
    return count

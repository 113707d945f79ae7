"""Linear layers on the CPU with their weights reordered once, at load, into oneDNN's blocked layout.

Why: given plain [out, in] weights, torch's bf16 matmul on the CPU (oneDNN's brgemm, AMX or AVX512_BF16)
rearranges them into its blocked layout (row pairs for the bf16 dot products) inside every call, for
every layer of every step. Reordered once (torch.ops.mkldnn._reorder_linear_weight, the packing torch's
own compiler applies to frozen linears), each call reads them as they lie: on an Intel Xeon with
AMX, 30 layers' matmuls at 64 rows went 25.8 -> 18.2 ms, at one row 18.7 -> 12.6 ms, prefill shapes
alike. float32 goes the same way on CPUs without AVX-512: torch's float32 linear calls MKL's sgemm,
which on an AMD EPYC (Zen 2) ran 30 layers' matmuls at 64 rows in 198 ms where oneDNN's packed kernel
took 143 (512 rows: 1,294 -> 861 ms), and the 64-prompt batch went 115.6 -> 103.4 s. The same
weights, the same math; only the summation order inside the kernel differs (float32: the largest
difference from torch's linear on one SmolLM2 shape was 2e-6), as between any two BLAS kernels:
greedy parity with transformers is tested. In bfloat16 on CPUs with AVX512_BF16 and no AMX, our own
kernel (bf16_linear.py) takes the layers it fits instead: faster there, above all at few rows; so does
our float32 one (f32_linear.py) where float32 is packed (AVX2): 1.65-1.96x at one row on a Zen 1.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple

import torch
from torch import nn

from engine import envvars
from engine.linear import bf16, f32_panels
from engine.linear.f32_blocks import F32BlockLinear
from engine.linear.swap import release_freed_memory, replace_linears


class _OurKernel(NamedTuple):
    module: ModuleType  # runs_here(lib), fits(linear)
    layer: type  # layer(linear, lib)
    switch: str  # the A/B variable: "0" keeps oneDNN's


# where packing_available, the layers our own kernel of that dtype fits take it instead of oneDNN's
OUR_KERNELS = {
    torch.bfloat16: _OurKernel(
        bf16, bf16.Bf16Linear, "ENGINE_BF16_LINEAR"
    ),  # AVX512_BF16, no AMX
    torch.float32: _OurKernel(
        f32_panels, f32_panels.F32Linear, "ENGINE_F32_LINEAR"
    ),  # AVX2 (where float32 is packed)
}

BATCH_HINT = (
    64  # the row count oneDNN chooses the layout for; 64 and 512 measured alike at 1-2,048 rows
)
# float32 layers are replaced at load on these CPUs (torch's capability): by the exact GGUF blocks
# (F32BlockLinear) wherever those are the weights; plain weights by our panels or oneDNN's only where
# that beat MKL's sgemm (AVX2); AVX-512 CPUs keep MKL for them (docs/performance.md).
FLOAT32_BLOCKS_ON = ("AVX2", "AVX512")
FLOAT32_PANELS_ON = ("AVX2",)


def our_kernel_library(dtype: torch.dtype):
    """The native library where our own linear kernel of this dtype runs here and is not switched off (its
    OUR_KERNELS switch), else None: oneDNN's packed kernel takes the layers."""
    kernel = OUR_KERNELS.get(dtype)
    if kernel is None or envvars.read(kernel.switch) == "0":
        return None
    from engine.kernels.cpu import load_native

    native = load_native()
    return native if kernel.module.runs_here(native) else None


def float32_panels_here(device: str) -> bool:
    """Whether plain float32 weights (not GGUF blocks) leave torch's linear at load on this CPU."""
    return (
        packing_available(torch.float32, device)
        and torch.backends.cpu.get_cpu_capability() in FLOAT32_PANELS_ON
    )


def packing_available(dtype: torch.dtype, device: str) -> bool:
    """Whether this torch build and CPU run oneDNN's packed linear in this dtype (float32 or bfloat16, the
    latter only where the CPU computes it natively) and ENGINE_PACK_WEIGHTS allows it."""
    if (
        dtype not in (torch.float32, torch.bfloat16)
        or torch.device(device).type != "cpu"
        or envvars.read("ENGINE_PACK_WEIGHTS") == "0"
    ):
        return False
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    ops = torch.ops.mkldnn
    if not all(
        hasattr(ops, op)
        for op in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
    ):
        return False
    if dtype == torch.float32:  # FLOAT32_BLOCKS_ON and FLOAT32_PANELS_ON say which layers
        return torch.backends.cpu.get_cpu_capability() in FLOAT32_BLOCKS_ON
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


def pack_linears(
    model: nn.Module,
    dtype: torch.dtype,
    device: str,
    copy_tied_head: bool = True,
    weights: Callable[[str], torch.Tensor] | None = None,
    panels: dict[str, torch.Tensor] | None = None,
    blocks: dict[str, tuple[int, torch.Tensor]] | None = None,
) -> int:
    """Every nn.Linear of the model swapped in place for a PackedLinear where packing_available (in bfloat16
    on CPUs with AVX512_BF16 and no AMX, for our own kernel's Bf16Linear where its shape fits; in float32 on
    AVX2 CPUs, for F32Linear where its shape fits); the count.
    A tied lm_head gets its own packed copy unless copy_tied_head is false (the embedding is gathered
    from, row by row, and stays plain): 1.5x faster logits in bfloat16, 2.3x in float32 at 64 rows (AMD
    Zen 2: 81 -> 35 ms), for vocab x hidden more memory (57 MB, 113 MB for SmolLM2-135M), which a
    float32 embedding mapped from the file (mapped_weight.py) gives back: only its gathered rows stay
    resident. The loader asks for no copy in float32 where the embedding could not be mapped.
    weights(name): the weight of a layer left on the meta device (the loader packs those from views of
    the file, weight_views.py), valid until the next call: every layer copies it into its own layout.
    panels: float32 layers' panels packed before (panel_cache.py), taken as they are by F32Linear.
    blocks: float32 layers' GGUF blocks whose values their weights are (f32_blocks.exact_blocks), for
    F32BlockLinear: their float weights are never read."""
    if not packing_available(dtype, device):
        return 0
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight

    kernel, lib = (
        OUR_KERNELS[dtype],
        our_kernel_library(dtype),
    )  # ours where it runs and is not switched off
    mkl = dtype == torch.float32 and not float32_panels_here(device)

    def make(name: str, linear: nn.Linear) -> nn.Module:
        if (
            blocks
            and name in blocks
            and lib is not None
            and dtype == torch.float32
            and kernel.module.fits(linear)
        ):
            return F32BlockLinear(*blocks[name], (linear.out_features, linear.in_features), lib)
        if panels and name in panels and lib is not None and not mkl and kernel.module.fits(linear):
            return f32_panels.F32Linear(linear, lib, panels[name])  # its weight never read
        from_views = weights is not None and linear.weight.is_meta
        if from_views:
            weight = weights(name)
            if tuple(weight.shape) != (
                linear.out_features,
                linear.in_features,
            ):  # load_state_dict's check, for these
                raise ValueError(
                    f"weights do not fit the model: {name}.weight is {tuple(weight.shape)} in the checkpoint, "
                    f"the config makes it {(linear.out_features, linear.in_features)}"
                )
            linear.weight = nn.Parameter(weight, requires_grad=False)
        if (
            name == "lm_head" and dtype == torch.bfloat16
        ):  # the loader makes it a Float32Head (float32 logits)
            return linear
        if tied and name == "lm_head" and not copy_tied_head:
            return linear
        if mkl:  # plain float32 weights stay torch's here; a view of the file goes away, a tied head gets its own
            if from_views or (tied and name == "lm_head"):
                linear.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
            return linear
        if lib is not None and kernel.module.fits(linear):
            return kernel.layer(linear, lib)
        return PackedLinear(linear)

    replace_linears(model, make)
    release_freed_memory(
        collect=False
    )  # the plain weights were freed when their layers were replaced
    return sum(
        isinstance(m, (PackedLinear, F32BlockLinear, *(k.layer for k in OUR_KERNELS.values())))
        for m in model.modules()
    )

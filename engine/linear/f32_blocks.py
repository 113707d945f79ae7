"""The exact float32 mode's linear layers kept as the GGUF blocks their weights were converted from
(engine/kernels/cpu/f32_block_linear.c).

The embedded model's float32 weights are the dequantized values of its GGUF's Q4_1 and Q8_0 blocks, each
value one rounding of d q + m with d q exact, which the kernel redoes in registers. It multiplies them with
the unrounded activations in f32_linear.c's order, so every output is bitwise F32Linear's on the converted
weights: the same logits and tokens, about a fifth of the bytes streamed a token, nothing to pack at start.
Unlike quantization="gguf", nothing is rounded that the exact mode does not round.

Used only where that equality is checked at load (exact_blocks): the model was converted from a GGUF,
every linear layer's blocks are of a type the kernel reads (Q4_0, Q4_1, Q8_0), and the first decoder
layer's four layers and the first CHECKED_HEAD_ROWS rows of the lm_head dequantize bitwise to the converted
weights (tests/test_f32_block_linear.py checks every layer of the embedded model). Anything else keeps the
float weights (the choice table's next rows), as does a layer whose shape the kernel does not take.
Under tensor parallelism the check is made on the rank's shard of the blocks against its shard of the
floats (engine/distributed/shard.py cuts both alike).
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.model.config import ModelConfig
from engine.linear.f32_panels import KernelLinear

PANEL = 16  # output rows a panel (f32_block_linear.c's NB)
Blocks = dict[
    str, tuple[int, torch.Tensor]
]  # layer name -> (ggml type, uint8 blocks [rows, bytes])
# the rows of a large layer (the lm_head's 49,152) checked at load; the tests check all
CHECKED_HEAD_ROWS = 4096


def runs_here(lib) -> bool:
    """Whether the library runs f32_block_linear on this CPU (built with AVX2, FMA and F16C)."""
    return lib is not None and hasattr(lib, "f32_block_linear") and lib.f32_blocks_support() == 1


class F32BlockLinear(KernelLinear):
    """y = x W^T, W the float32 values of a GGUF tensor's blocks, held as the blocks in the kernel's panels."""

    def __init__(self, kind: int, blocks: torch.Tensor, shape: tuple[int, int], lib) -> None:
        """blocks: uint8 [out, row bytes], the file's rows of blocks in the model's row order."""
        super().__init__()
        self.kind, (self.out_features, self.in_features) = kind, shape
        size = lib.f32_blocks_bytes(kind, self.out_features, self.in_features)
        if not size or blocks.dtype != torch.uint8 or blocks.shape[0] != self.out_features:
            raise ValueError(
                f"f32_block_linear does not take {self.out_features} x {self.in_features} blocks of "
                f"ggml type {kind}"
            )
        self.packed = torch.empty(size, dtype=torch.uint8)
        blocks = blocks.contiguous()
        if lib.f32_blocks_pack(
            kind,
            blocks.data_ptr(),
            self.out_features,
            self.in_features,
            self.packed.data_ptr(),
            torch.get_num_threads(),
        ):
            raise ValueError(
                f"f32_block_linear cannot pack {self.out_features} x {self.in_features} blocks"
            )
        self._lib = lib
        self._bound: Callable[[int, int, int], None] | None = None

    def kernel_call(self) -> Callable[[int, int, int], None]:
        """f(x_ptr, y_ptr, m), as F32Linear.kernel_call."""
        if self._bound is None:
            lib, kind, k, packed, n = (
                self._lib,
                self.kind,
                self.in_features,
                self.packed.data_ptr(),
                self.out_features,
            )

            def call(x: int, y: int, m: int) -> None:
                if lib.f32_block_linear(kind, x, m, k, packed, n, y, torch.get_num_threads()):
                    raise RuntimeError("f32_block_linear refused a shape it packed")

            self._bound = call
        return self._bound

    def decode_linear(self) -> dict:
        """The layer as engine/model/decode_layers.py hands it to the C step."""
        return {
            "kind": "f32blocks",
            "arg": self.kind,
            "threads": torch.get_num_threads(),
            "w": self.packed.data_ptr(),
        }

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, bias=False, GGUF blocks, exact float32"


def file_blocks(
    model_dir: str,
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, int]],
    reference: Callable[[str], torch.Tensor],
    lib,
) -> Blocks | None:
    """name -> (ggml type, blocks) for every linear layer of the whole model, from the GGUF it was
    converted from, where every layer's type is one the kernel reads; else None. Not yet checked."""
    if not runs_here(lib):
        return None
    from engine.linear.gguf import gguf_source, read_blocks

    if gguf_source(model_dir) is None:
        return None
    qkv = "layers.0.self_attn.qkv_proj"
    try:
        blocks = read_blocks(model_dir, cfg, shapes, {f"{qkv}.weight": reference(qkv).clone()})
    # a block type the kernel does not read, a file that does not fit: float panels
    except (ValueError, OSError):
        return None
    if set(blocks) != set(shapes) or any(
        not lib.f32_blocks_bytes(k, PANEL, 32) for k, _ in blocks.values()
    ):
        return None
    return blocks


def checked_blocks(
    blocks: Blocks,
    shapes: dict[str, tuple[int, int]],
    reference: Callable[[str], torch.Tensor],
    lib,
) -> Blocks | None:
    """The blocks (the whole model's, or a rank's shard of them) the kernel takes, where the checked
    layers dequantize bitwise to their float weights (reference(name): the same whole or shard); else
    None. A layer the kernel does not take (rows not in whole panels of 16, a shard that cut its blocks
    apart) is left out: the table gives it the next row."""
    from engine.linear.gguf import dequantize

    taken = {
        n: (kind, b)
        for n, (kind, b) in blocks.items()
        if n in shapes and lib.f32_blocks_bytes(kind, *shapes[n])
    }
    checked = [n for n in taken if n.startswith("layers.0.") or n == "lm_head"]
    if not checked:
        return None
    for name in checked:
        kind, b = taken[name]
        rows = min(shapes[name][0], CHECKED_HEAD_ROWS)
        if not torch.equal(dequantize(kind, b[:rows], shapes[name][1]), reference(name)[:rows]):
            return None
    return taken


def exact_blocks(
    model_dir: str,
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, int]],
    reference: Callable[[str], torch.Tensor],
    lib,
) -> Blocks | None:
    """name -> (ggml type, blocks) for the linear layers whose exact float32 weights are the blocks'
    values (see the top) and whose shape the kernel takes; None where the model's are not, and the
    layers keep their float panels. reference(name): the layer's converted float32 weight (a view
    valid until the next call)."""
    blocks = file_blocks(model_dir, cfg, shapes, reference, lib)
    return None if blocks is None else checked_blocks(blocks, shapes, reference, lib)

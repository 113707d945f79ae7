"""Each implementation made from the table's choice for a layer, out of what it needs from the weights:
the float weight (read, or a view of the file packed at once), GGUF blocks, cached panels, int8 weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from engine.linear.base import LinearLayer
from engine.linear.bf16 import Bf16Linear
from engine.linear.choose import Choice
from engine.linear.f32_blocks import F32BlockLinear
from engine.linear.f32_head import Float32Head
from engine.linear.f32_panels import F32Linear
from engine.linear.gguf import GGUFLinear
from engine.linear.int8 import Int8Linear
from engine.linear.onednn import PackedLinear

# implementations that take the float weight from a view of the file (the loader leaves it unread)
FROM_FILE = {"torch_copy", "onednn", "bf16", "f32_panels"}
# implementations that never need the float weight
NO_FLOATS = {"f32_blocks", "f32_panels_cached", "gguf", "gguf-q8"}


@dataclass
class Sources:
    """What the layers are made from. file_weight(name): a layer's float weight as a view of the file,
    valid until the next call (weight_views.py); blocks: GGUF blocks by layer (the gguf modes' or the
    exact float32 ones); panels: f32_linear panels mapped from the cache; stored: int8 weights from the
    cache. fresh: int8 weights quantized here, for the cache."""

    lib: object = None
    tied: bool = False
    file_weight: Callable[[str], torch.Tensor] | None = None
    blocks: dict | None = None
    panels: dict | None = None
    stored: dict | None = None
    fresh: dict[str, torch.Tensor] = field(default_factory=dict)


def _float_weight(name: str, linear: nn.Linear, src: Sources) -> bool:
    """The layer's weight from the file where the loader left it unread; whether it was."""
    if not linear.weight.is_meta or src.file_weight is None:
        return False
    weight = src.file_weight(name)
    if tuple(weight.shape) != (linear.out_features, linear.in_features):
        raise ValueError(
            f"weights do not fit the model: {name}.weight is {tuple(weight.shape)} in the checkpoint, "
            f"the config makes it {(linear.out_features, linear.in_features)}"
        )
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return True


def make(choice: Choice, name: str, linear: nn.Linear, src: Sources) -> LinearLayer:
    """The layer `name` as its choice's implementation (torch's: the layer itself)."""
    impl, lib, threads = choice.impl, src.lib, torch.get_num_threads()
    shape = (linear.out_features, linear.in_features)
    if impl == "f32_blocks":
        return F32BlockLinear(*src.blocks[name], shape, lib)
    if impl == "f32_panels_cached":
        return F32Linear(linear, lib, src.panels[name])  # its weight never read
    if impl in ("gguf", "gguf-q8"):  # gguf-q8 repacks the blocks: each file copy goes once packed
        take = src.blocks.pop if impl == "gguf-q8" else src.blocks.__getitem__
        return GGUFLinear(*take(name), shape, linear.bias, lib, threads, impl == "gguf-q8")
    if impl == "int8":
        known = None
        if src.stored is not None:
            known = (src.stored[f"{name}.qweight"], src.stored[f"{name}.scale"])
        layer = Int8Linear(linear.weight, linear.bias, lib, threads, known)
        src.fresh[f"{name}.qweight"], src.fresh[f"{name}.scale"] = layer.qweight, layer.scale
        return layer
    from_file = _float_weight(name, linear, src) if impl in FROM_FILE else False
    if impl == "torch":
        return linear
    if impl == "f32_head":
        return Float32Head(linear, lib)
    if impl == "torch_copy":  # its own memory: not a view of the file, not the tied embedding
        if from_file or (src.tied and name == "lm_head"):
            linear.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        return linear
    if impl == "bf16":
        return Bf16Linear(linear, lib)
    if impl == "f32_panels":
        return F32Linear(linear, lib)
    if impl == "onednn":
        return PackedLinear(linear)
    raise ValueError(f"no implementation named {impl!r}")

"""quantization='gguf': the linear layers computed from the GGUF file's own blocks, never dequantized whole.

Why: the embedded model ships as a GGUF whose layers are Q4_1 and whose tied lm_head is Q8_0. The exact
mode dequantizes them once to float32; this mode reads the blocks as they are, a fraction of the bytes a
token, through engine/kernels/cpu/gguf_linear.c. Its weights are the exact mode's; the activations are
rounded per block of 32 to int16 for integer dot products (llama.cpp rounds them to int8, which costs
perplexity; int16 costs nothing measurable, docs/quantization.md). From 12 rows on (a batch's decode step,
prefill), layers whose width is a multiple of 16 go to gguf_panel_linear.c, which dequantizes 16 output
rows' blocks at a time into a float32 buffer and multiplies them by the same rounded activations: each
output then is bitwise the same in any batch of 12 rows or more, and agrees with the integer loop's to
float rounding. Other widths, and builds without AVX2, keep the integer loop up to DIRECT_MAX_ROWS rows
and dequantized tiles (engine/linear/quantized.py) beyond.

The blocks of each layer are the file's rows, one row of blocks per output row, so fused layers (qkv,
gate_up) are the parts' rows stacked. Llama GGUFs store q and k with their rows permuted for
llama.cpp's rotary layout; the first layer's q and k are compared with the converted float weights to
tell which order a file uses (or to refuse a file that matches neither).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from engine.model.config import ModelConfig
from engine.model.embedded import conversion_source
from engine.linear.quantized import QuantizedLinear

BLOCK = 32
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # ggml type id -> bytes per 32 weights: Q4_0, Q4_1, Q8_0
TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
# the types we do not read, for the refusal's wording
GGML_TYPES = {
    0: "F32",
    1: "F16",
    6: "Q5_0",
    7: "Q5_1",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    30: "BF16",
}
ROUND_STEPS = 32767.0  # activations are rounded per block to int16 (QX_MAX in gguf_linear.c)
ACT_INT8 = 0x100  # gguf_panel_linear's type flag: int8 activations, weights in gguf_q8_pack's panels (gguf_blocks.h)
# layers not in panels: more input rows multiply dequantized tiles (docs/quantization.md)
DIRECT_MAX_ROWS = 64
PANEL = 16  # output rows gguf_panel_linear.c dequantizes together


def gguf_source(model_dir: str) -> Path | None:
    """The GGUF a converted model directory was made from (engine/model/embedded.py marks it), or None."""
    source = conversion_source(Path(model_dir))
    return Path(source[0]) if source is not None and Path(source[0]).is_file() else None


def _parts(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    b = f"blk.{i}."
    return {
        f"layers.{i}.self_attn.qkv_proj": [
            b + "attn_q.weight",
            b + "attn_k.weight",
            b + "attn_v.weight",
        ],
        f"layers.{i}.self_attn.o_proj": [b + "attn_output.weight"],
        f"layers.{i}.mlp.gate_up_proj": [b + "ffn_gate.weight", b + "ffn_up.weight"],
        f"layers.{i}.mlp.down_proj": [b + "ffn_down.weight"],
    }


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation: within each head, GGUF row 2i+j is HF row j*D/2+i."""
    d = rows // heads
    h, j, i = torch.meshgrid(
        torch.arange(heads), torch.arange(2), torch.arange(d // 2), indexing="ij"
    )
    return (h * d + 2 * i + j).reshape(-1)


def dequantize(kind: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """[N, row bytes] blocks -> float32 [N, k], in Python, as gguf's reference does it (tests, checks)."""
    raw = blocks.reshape(blocks.shape[0], k // BLOCK, BLOCK_BYTES[kind])
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    if kind == 8:
        q = raw[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(-1, k)
    qs = raw[..., 4:] if kind == 3 else raw[..., 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    m = raw[..., 2:4].contiguous().view(torch.float16).float() if kind == 3 else -8.0 * d
    return (d * q + m).reshape(-1, k)


def read_blocks(
    model_dir: str,
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, int]],
    reference: dict[str, torch.Tensor],
) -> dict[str, tuple[int, torch.Tensor]]:
    """name -> (ggml type, uint8 blocks [out, row bytes]) for every linear layer. reference: the float
    weights of layers.0.self_attn.qkv_proj (to tell the q/k row order). ValueError naming what does not fit."""
    from engine.model.gguf_file import read_index, read_tensor

    source = gguf_source(model_dir)
    if source is None:
        raise ValueError(
            f"quantization='gguf' needs a model loaded from a .gguf file; {model_dir} was not made from one"
        )
    tensors = read_index(source)

    def take(name: str) -> tuple[int, torch.Tensor]:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{source.name} has no tensor {name}")
        if t.kind not in BLOCK_BYTES:
            raise ValueError(
                f"quantization='gguf' reads {'/'.join(TYPE_NAMES.values())} blocks; {source.name}'s "
                f"{name} is {GGML_TYPES.get(t.kind, f'of ggml type {t.kind}')}"
            )
        if not t.dims or t.dims[0] % BLOCK:
            raise ValueError(
                f"{source.name}: {name} has rows of {t.dims[:1]} weights, not a multiple of {BLOCK}"
            )
        return t.kind, read_tensor(source, t, t.dims[0] // BLOCK * BLOCK_BYTES[t.kind])

    plan = {name: parts for i in range(cfg.num_layers) for name, parts in _parts(cfg, i).items()}
    plan["lm_head"] = ["token_embd.weight" if cfg.tie_word_embeddings else "output.weight"]
    q_rows, k_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # permuted, as stored
    orders = (
        (unpermute_rows(q_rows, cfg.num_heads), unpermute_rows(k_rows, cfg.num_kv_heads)),
        None,
    )
    order, decided = None, False  # None is also an answer: the rows are as stored
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for name, parts in plan.items():
        got = [take(p) for p in parts]
        kinds = {k for k, _ in got}
        if len(kinds) != 1:
            raise ValueError(
                f"quantization='gguf': the parts of {name} ({parts}) are of different block types"
            )
        kind = kinds.pop()
        if name.endswith("qkv_proj"):
            if [b.shape[0] for _, b in got] != [q_rows, k_rows, k_rows]:
                raise ValueError(
                    f"{source.name}: the q/k/v tensors of {name} have {[b.shape[0] for _, b in got]} rows, "
                    f"the config says {[q_rows, k_rows, k_rows]}"
                )
            if not decided:
                order, decided = (
                    _qkv_order(got, kind, orders, reference, shapes[name][1], source.name),
                    True,
                )
            if order is not None:
                got[0] = (kind, got[0][1][order[0]])
                got[1] = (kind, got[1][1][order[1]])
        blocks = torch.cat([b for _, b in got]).contiguous()
        n, k = shapes[name]
        if k % BLOCK or tuple(blocks.shape) != (n, k // BLOCK * BLOCK_BYTES[kind]):
            raise ValueError(f"{source.name}: the blocks of {name} do not fit its shape {n} x {k}")
        out[name] = (kind, blocks)
    return out


def _qkv_order(got, kind, orders, reference, k: int, source: str):
    """Which row order of q and k makes the first layer's blocks equal its converted float weights."""
    want = reference["layers.0.self_attn.qkv_proj.weight"].float()
    for perm in orders:
        q, kk = got[0][1], got[1][1]
        if perm is not None:
            q, kk = q[perm[0]], kk[perm[1]]
        mine = dequantize(kind, torch.cat([q, kk, got[2][1]]), k)
        if mine.shape == want.shape and torch.allclose(mine, want, rtol=1e-5, atol=1e-6):
            return perm
    raise ValueError(
        f"{source}: the first layer's q/k/v blocks match the converted weights in no known row order"
    )


def round_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, k] as the kernel sees it (each block of 32 rounded to int16 steps of max|x|/32767, as
    quantize_x in gguf_linear.c), and per block sum(x - rounded x) [M, k / 32]."""
    b = x.reshape(x.shape[0], -1, BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    # as the kernel: 1/d stays finite
    d = torch.where(amax > 1e-30, amax / ROUND_STEPS, torch.zeros_like(amax))
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    rounded = torch.round(b * inv) * d
    # each difference exact, as gguf_panel_linear.c sums it
    return rounded.reshape(x.shape), (b - rounded).sum(-1)


def block_offsets(kind: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Each block's offset m (w = d q + m): Q4_1's stored min, Q4_0's -8 d; float32 [N, k / 32]."""
    raw = blocks.reshape(blocks.shape[0], k // BLOCK, BLOCK_BYTES[kind])
    if kind == 3:
        return raw[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    return -8.0 * raw[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)


class GGUFLinear(QuantizedLinear):
    """A frozen linear layer holding a GGUF tensor's blocks (and a float32 bias, where the model has one);
    int8_activations: x rounded per block to int8 rather than int16 (quantization="gguf-q8")."""

    kind_name, direct_max_rows = "GGUF-block", DIRECT_MAX_ROWS

    def __init__(
        self,
        kind: int,
        blocks: torch.Tensor,
        shape: tuple[int, int],
        bias: torch.Tensor | None,
        lib,
        threads: int,
        int8_activations: bool = False,
    ) -> None:
        super().__init__()
        self.kind, (self.out_features, self.in_features) = kind, shape
        self.int8_activations = int8_activations
        self._arg = kind | ACT_INT8 if int8_activations else kind  # the kernels' type argument
        # the blocks repacked into panels of 8 rows for gguf_q8_linear.c (the same bytes' worth)
        if int8_activations:
            size = (
                0
                if lib is None or not hasattr(lib, "gguf_q8_pack")
                else lib.gguf_q8_bytes(kind, *shape)
            )
            packed = torch.empty(size, dtype=torch.uint8)
            if not size or lib.gguf_q8_pack(
                kind, blocks.contiguous().data_ptr(), shape[0], shape[1], packed.data_ptr()
            ):
                raise ValueError(
                    f"quantization='gguf-q8' cannot take {shape[0]} x {shape[1]} blocks of "
                    f"{TYPE_NAMES.get(kind, kind)}"
                )
            blocks = packed
        self.register_buffer("blocks", blocks)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.float32).contiguous()
        )
        self._lib, self._threads = lib, threads
        panels = (
            lib is not None and self.out_features % PANEL == 0 and lib.gguf_panel_vectorized() == 1
        )
        # every call to gguf_panel_linear; int8 activations: every call to the integer kernel (it takes them
        # there), never the tiles: a row's output is then bitwise the same in any batch (gguf_panel_linear.c)
        self.direct_max_rows = sys.maxsize if panels or int8_activations else DIRECT_MAX_ROWS

    def _dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        # never needed: every row count goes to the kernel (direct_max_rows)
        if self.int8_activations:
            raise NotImplementedError(
                "a gguf-q8 layer holds its blocks packed for gguf_q8_linear.c"
            )
        rc = self._lib.gguf_dequantize(
            self.kind,
            self.blocks[r0:r1].data_ptr(),
            out.data_ptr(),
            r1 - r0,
            self.in_features,
            self._threads,
        )
        if rc != 0:
            raise RuntimeError(f"gguf_dequantize failed with code {rc}")

    def _kernel_args(self):
        bias = None if self.bias is None else self.bias.data_ptr()
        # gguf_linear below 12 rows
        return (
            self._lib.gguf_panel_linear,
            (self._arg,),
            (self.blocks.data_ptr(), bias),
        )

    def decode_linear(self) -> dict:
        """The layer as engine/model/decode_layers.py hands it to the C step (the addresses _kernel_args passes)."""
        bias = None if self.bias is None else self.bias.data_ptr()
        return {
            "kind": "gguf",
            "arg": self._arg,
            "threads": self._threads,
            "w": self.blocks.data_ptr(),
            "bias": bias,
        }

    def _activations(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tiles multiply x rounded as the kernel rounds it, and the offsets m multiply the float sums
        of x (the residue corrects for the rounded ones): a prompt's logits do not depend on how its rows
        were batched, prefilled whole or met a few rows at a time."""
        return round_blocks(rows)  # int8 activations never come here (direct_max_rows)

    def _correct(self, part: torch.Tensor, r0: int, r1: int, residue: torch.Tensor) -> None:
        if self.kind != 8:  # Q8_0 has no offsets
            part.addmm_(residue, block_offsets(self.kind, self.blocks[r0:r1], self.in_features).T)

    def extra_repr(self) -> str:
        acts = "int8" if self.int8_activations else "int16"
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, GGUF {TYPE_NAMES[self.kind]} blocks, {acts} activations"

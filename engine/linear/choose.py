"""The one table that picks each linear layer's implementation at load, and the model's decode path.

Rows are read top to bottom; a layer takes the first row whose `here` (facts about this load: mode,
dtype, device, CPU, weights found) and `fits` (the layer: shape, bias, lm_head, tied) both hold. Every
row can be turned off, and rows marked opt-in on, by EngineConfig.kernel_overrides ({row name: "off" or
"on"}): the A/B facility for benchmarks and tests. Nothing here imports torch: EngineConfig checks names.
Under tensor parallelism (`tp`) each layer is a rank's shard: the exact float32 mode's GGUF blocks are
the rank's shard of them, rows that take a whole file's weights (cached panels, the embedding as the
head) step aside, and decode steps take the plain forward, which sums the ranks' outputs between the
layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable


@dataclass(frozen=True)
class Where:
    """What the table knows about this load. CPU facts are False off the CPU."""

    mode: str  # quantization: none, int8, gguf, gguf-q8
    dtype: str  # float32 or bfloat16
    device: str  # cpu, cuda
    tied: bool  # the lm_head is the embedding
    # torch's oneDNN reorders this dtype's weights here (onednn.packing_available)
    packs: bool = False
    avx2_only: bool = False  # the CPU is AVX2 without AVX-512 (torch's capability)
    bf16_kernel: bool = False  # our bf16_linear runs here (AVX512_BF16, no AMX)
    f32_kernel: bool = False  # our f32_linear runs here (AVX2, FMA)
    f32_blocks_kernel: bool = False  # our f32_block_linear runs here (AVX2, FMA, F16C)
    # the float32 weights are their GGUF blocks' values (checked; under tp, each rank's shard)
    exact_blocks: bool = False
    # layers the kernel does not take from blocks (their shape or shard): the next row takes them
    unblocked: frozenset[str] = frozenset()
    cached_panels: frozenset[str] = frozenset()  # layers whose f32_linear panels the cache holds
    embedding_mapped: bool = False  # the embedding stays mapped from the file (mapped_weight.py)
    # tensor parallel (each layer a rank's shard, engine/distributed/shard.py), or a whole model
    # summed like ranks (reduce_like_tp): the rows ranks take
    tp: bool = False
    overrides: dict[str, str] = field(default_factory=dict)

    def on(self, row: str) -> bool:
        """Whether a row takes part: its default unless kernel_overrides names it."""
        wanted = self.overrides.get(row)
        return ROWS_BY_NAME[row].default_on if wanted is None else wanted == "on"

    def found(self, **facts) -> Where:
        """This Where with facts about the weights added (exact blocks, cached panels, mapping)."""
        return replace(self, **facts)


@dataclass(frozen=True)
class Layer:
    """A linear layer as the table sees it."""

    name: str
    out_features: int
    in_features: int
    bias: bool

    @property
    def is_head(self) -> bool:
        return self.name == "lm_head"

    @property
    def panels_fit(self) -> bool:  # f32_linear and f32_block_linear: no bias, 16-row panels
        return not self.bias and self.out_features % 16 == 0

    @property
    def bf16_fits(self) -> bool:  # bf16_linear: no bias, even K, N a multiple of 16
        return not self.bias and self.in_features % 2 == 0 and self.out_features % 16 == 0


@dataclass(frozen=True)
class Row:
    name: str
    impl: str  # engine/linear/build.py's name for the implementation
    here: Callable[[Where], bool]
    reason: str
    fits: Callable[[Layer, Where], bool] = lambda layer, where: True
    default_on: bool = True  # False: an opt-in row, taken only when kernel_overrides turns it "on"


def _exact(w: Where) -> bool:
    return w.mode == "none" and w.dtype == "float32"


def _packed(w: Where, dtype: str) -> bool:
    return w.mode == "none" and w.dtype == dtype and w.packs


ROWS: tuple[Row, ...] = (
    Row("int8", "int8", lambda w: w.mode == "int8", "weight-only int8, per-row scales, our kernel"),
    Row("gguf", "gguf", lambda w: w.mode == "gguf", "the GGUF file's blocks, int16 activations"),
    Row("gguf-q8", "gguf-q8", lambda w: w.mode == "gguf-q8", "GGUF blocks, int8 activations"),
    Row(
        "f32-head",
        "f32_head",
        lambda w: w.mode == "none" and w.dtype == "bfloat16",
        "bfloat16 logits tie near the top: the lm_head computes in float32",
        fits=lambda layer, w: layer.is_head,
    ),
    Row(
        "torch-plain",
        "torch",
        lambda w: w.mode == "none",
        "A/B: torch's linear on the weights as read, nothing packed",
        default_on=False,
    ),
    Row(
        "f32-blocks",
        "f32_blocks",
        lambda w: _packed(w, "float32") and w.f32_kernel and w.f32_blocks_kernel,
        "the float32 weights are GGUF blocks' values: the blocks, bitwise the same outputs",
        fits=lambda layer, w: layer.panels_fit and w.exact_blocks and layer.name not in w.unblocked,
    ),
    Row(
        "f32-panels-cached",
        "f32_panels_cached",
        lambda w: _packed(w, "float32") and w.f32_kernel and w.avx2_only and not w.tp,
        "f32_linear's panels mapped from the cache instead of packed at start",
        fits=lambda layer, w: layer.panels_fit and layer.name in w.cached_panels,
        default_on=False,
    ),
    Row(
        "tied-head-shared",
        "torch",
        lambda w: _exact(w) and w.tied and not w.embedding_mapped and not w.tp,
        "the embedding is read into memory: the lm_head multiplies it, no copy",
        fits=lambda layer, w: layer.is_head,
    ),
    Row(
        "f32-mkl",
        "torch_copy",
        lambda w: _packed(w, "float32") and not w.avx2_only,
        "AVX-512: MKL's sgemm beats oneDNN's and our float32 kernels",
    ),
    Row(
        "f32-panels",
        "f32_panels",
        lambda w: _packed(w, "float32") and w.f32_kernel,
        "AVX2: our float32 kernel beats oneDNN's and MKL's",
        fits=lambda layer, w: layer.panels_fit,
    ),
    Row(
        "bf16-kernel",
        "bf16",
        lambda w: _packed(w, "bfloat16") and w.bf16_kernel,
        "AVX512_BF16 without AMX: our bf16 kernel beats oneDNN's",
        fits=lambda layer, w: layer.bf16_fits,
    ),
    Row(
        "onednn",
        "onednn",
        lambda w: w.mode == "none" and w.packs,
        "oneDNN's layout, reordered once at load instead of in every call",
    ),
    Row("torch", "torch", lambda w: True, "torch's own linear on the weights as read"),
)

# decode paths: the first that holds. `fused` needs every decoder layer on a direct kernel call.
F32_KERNELS = {"f32_blocks", "f32_panels", "f32_panels_cached"}
DIRECT_KERNELS = {
    "int8",
    "gguf",
    "gguf-q8",
    "f32_blocks",
    "f32_panels",
    "f32_panels_cached",
    "bf16",
}
DECODE_ROWS: tuple[Row, ...] = (
    Row(
        "tensor-parallel",
        "plain",
        lambda w: w.tp,
        "tensor parallel (or reduce_like_tp): the plain forward sums the shards' outputs between "
        "layers; fused steps cannot",
    ),
    Row(
        "decode-layers-c",
        "fused-c",
        lambda w: w.dtype == "float32",
        "a float32 decode step's layers in one C call, where the attention backend allows",
    ),
    Row(
        "fused-decode",
        "fused",
        lambda w: True,
        "decode steps call each layer's kernel directly, elementwise ops fused (fused_decode.py)",
    ),
    Row("plain", "plain", lambda w: True, "llama.py's forward, op by op"),
)
# prefill attention: the native backend's C kernel where its build and head_dim allow, else torch's SDPA
ATTENTION_ROWS: tuple[Row, ...] = (
    Row(
        "native-extend", "native", lambda w: True, "prefill attention in our C kernel (extend_*.c)"
    ),
)
ROWS_BY_NAME = {row.name: row for row in (*ROWS, *DECODE_ROWS, *ATTENTION_ROWS)}
FIXED_ROWS = ("torch", "plain", "tensor-parallel")  # rows no override turns off


@dataclass(frozen=True)
class Choice:
    row: str
    impl: str
    reason: str


def check_overrides(overrides: dict[str, str]) -> None:
    """ValueError naming an unknown row or value in EngineConfig.kernel_overrides."""
    for name, value in overrides.items():
        if name not in ROWS_BY_NAME or name in FIXED_ROWS:
            known = ", ".join(n for n in ROWS_BY_NAME if n not in FIXED_ROWS)
            raise ValueError(f"kernel_overrides: unknown row {name!r}; the rows are {known}")
        if value not in ("on", "off"):
            raise ValueError(f"kernel_overrides[{name!r}] must be 'on' or 'off', got {value!r}")


def may_use(where: Where, row: str) -> bool:
    """Whether a row can apply at this load (before the weights are looked at)."""
    return where.on(row) and ROWS_BY_NAME[row].here(where)


def choose(where: Where, layer: Layer) -> Choice:
    """The first row that takes this layer."""
    for row in ROWS:
        if row.name == "torch" or (
            where.on(row.name) and row.here(where) and row.fits(layer, where)
        ):
            return Choice(row.name, row.impl, row.reason)
    raise AssertionError("the last row takes every layer")


def choose_decode_path(where: Where, impls: set[str]) -> Choice:
    """The decode path for a model whose decoder layers run on these implementations. The exact mode
    takes the fused path only where all its layers are one kernel family (bitwise its plain forward)."""
    fused = (
        bool(impls)
        and impls <= DIRECT_KERNELS
        and (where.mode != "none" or impls == {"bf16"} or impls <= F32_KERNELS)
    )
    for row in DECODE_ROWS:
        forced = row.name in FIXED_ROWS and row.here(where)  # plain, or under tensor parallelism
        if forced or (fused and where.on(row.name) and row.here(where)):
            if row.name == "decode-layers-c" and not where.on("fused-decode"):
                continue
            return Choice(row.name, row.impl, row.reason)
    raise AssertionError("plain takes every model")


def native_extend(overrides: dict[str, str]) -> bool:
    """Whether the native attention backend may run prefill in C (create_backend's native_extend)."""
    return overrides.get("native-extend", "on") == "on"


def table() -> str:
    """The rows, as `engine info` prints them."""
    lines = []
    for row in (*ROWS, *DECODE_ROWS, *ATTENTION_ROWS):
        opt = " (opt-in)" if not row.default_on else ""
        lines.append(f"  {row.name:<18} {row.impl:<18} {row.reason}{opt}")
    return "\n".join(lines)

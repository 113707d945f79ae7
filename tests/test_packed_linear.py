"""Linear layers with oneDNN-packed weights (engine/linear/onednn.py) and our bfloat16 kernel
(engine/linear/bf16.py): the same products as torch's linear within the dtype's rounding, taken
by the loader for float32 and bfloat16 on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.model.config import load_hf_config
from engine.kernels.cpu import load_native
from engine.linear import bf16, f32_panels
from engine.linear.bf16 import Bf16Linear
from engine.linear.f32_panels import F32Linear

# the model's plain layers: nn.Linear without its random init
from engine.linear.torch import (
    Linear,
)
from engine.model.loader import load_model
from engine.linear.onednn import PackedLinear, packing_available

# SmolLM2-135M's qkv, gate_up, down, lm_head
SHAPES = [
    (576, 960),
    (576, 3072),
    (1536, 576),
    (576, 49152),
]


def _within_rounding(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> None:
    """got is the exact product (float64) up to one rounding of the result to its dtype plus float32
    accumulation error (K terms, each bounded by |x||w|), the bound torch's own linear also keeps."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T
    unit = 2**-8 if got.dtype == torch.bfloat16 else 2**-24
    bound = unit * exact.abs() + x.shape[-1] * 2**-23 * scale + 1e-30
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"worst error {float((err / bound).max()):.2f} x the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_is_torch_linear_within_rounding(rows, dtype):
    if not packing_available(dtype, "cpu"):
        pytest.skip(f"oneDNN does not pack {dtype} here: the table keeps torch's linear")
    gen = torch.Generator().manual_seed(rows)
    for k, n in SHAPES:
        lin = nn.Linear(k, n, bias=(n == 960)).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
            if lin.bias is not None:
                lin.bias.copy_(torch.randn(n, generator=gen))
        x = torch.randn(rows, k, generator=gen).to(dtype)
        packed = PackedLinear(lin)
        got = packed(x)
        assert got.dtype == dtype and got.shape == (rows, n)
        _within_rounding(got, x, lin.weight, lin.bias)
        # the bound is one torch's linear keeps too
        _within_rounding(lin(x), x, lin.weight, lin.bias)
        # leading dims kept
        assert torch.equal(packed(x.reshape(1, rows, k)), got.reshape(1, rows, n))


def _bf16_kernel_here() -> bool:
    lib = load_native()
    return bf16.runs_here(lib)


def test_bf16_kernel_is_taken_exactly_where_the_cpu_has_avx512_bf16_and_no_amx():
    """The build decides by #if on the compiler's -march=native: a broken condition would turn the kernel
    off everywhere and let every test below pass without it."""
    lib = load_native()
    if lib is None:
        pytest.fail("no C compiler: the native kernels could not be built on this machine")
    flags = Path("/proc/cpuinfo").read_text().split()
    assert _bf16_kernel_here() == ("avx512_bf16" in flags and "amx_bf16" not in flags)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 64, 65, 300])
def test_bf16_kernel_is_torch_linear_within_rounding(rows):
    """Every panel width (3, 2 and 1 groups of 16 columns), row counts around the 8-row tiles, one and
    two threads, an input starting at an odd element; and the same values as oneDNN's packed linear but
    for the order of float32 sums (about 1 in 20,000)."""
    lib = load_native()
    if not _bf16_kernel_here():
        pytest.skip("this CPU has no AVX512_BF16, or has AMX: bfloat16 keeps oneDNN (test above)")
    gen = torch.Generator().manual_seed(rows)
    differ = total = 0
    for k, n in [*SHAPES, (64, 32), (62, 16)]:
        lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        assert bf16.fits(lin)
        ours = Bf16Linear(lin, lib)
        assert ours.nr == bf16.panel_columns(n) and n % (16 * ours.nr) == 0
        got = ours(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        _within_rounding(got, x, lin.weight, None)
        # leading dims kept
        assert torch.equal(ours(x.reshape(1, rows, k)), got.reshape(1, rows, n))
        # 2 bytes past an alignment
        odd = torch.empty(rows * k + 1, dtype=torch.bfloat16)[1:].view(rows, k)
        odd.copy_(x)
        assert torch.equal(ours(odd), got)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            # the panels' split among threads does not change a value
            assert torch.equal(ours(x), got)
        finally:
            torch.set_num_threads(threads)
        if packing_available(torch.bfloat16, "cpu"):
            onednn = PackedLinear(lin)(x)
            differ, total = differ + int((onednn != got).sum()), total + got.numel()
    assert differ <= total * 1e-3, f"{differ} of {total} values differ from oneDNN's"


def test_bf16_kernel_refuses_what_it_cannot_take():
    lib = load_native()
    if not _bf16_kernel_here():
        pytest.skip(
            "this CPU has no AVX512_BF16, or has AMX: bfloat16 keeps oneDNN (the test above)"
        )
    assert bf16.fits(nn.Linear(64, 48, bias=False).bfloat16())
    assert not bf16.fits(nn.Linear(64, 48, bias=True).bfloat16())  # a bias: oneDNN's
    assert not bf16.fits(nn.Linear(63, 48, bias=False).bfloat16())  # odd K
    assert not bf16.fits(nn.Linear(64, 40, bias=False).bfloat16())  # N not a multiple of 16
    assert not bf16.fits(nn.Linear(64, 48, bias=False))  # float32
    ours = Bf16Linear(nn.Linear(64, 48, bias=False).bfloat16(), lib)
    with pytest.raises(TypeError, match="bfloat16"):
        ours(torch.randn(2, 64))
    assert ours(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 48)


def test_loader_packs_on_the_cpu_unless_told_not_to(tiny_llama_dir, monkeypatch):
    hf_config = load_hf_config(tiny_llama_dir)

    def linears(dtype, **overrides):
        model, cfg = load_model(
            tiny_llama_dir, hf_config, dtype, "cpu", 64, kernel_overrides=overrides
        )
        kinds = {
            type(m)
            for m in model.modules()
            if isinstance(m, (nn.Linear, PackedLinear, Bf16Linear, F32Linear))
        }
        return model, cfg, kinds

    model, _, kinds = linears(torch.float32)
    avx2 = (
        packing_available(torch.float32, "cpu")
        and torch.backends.cpu.get_cpu_capability() == "AVX2"
    )
    if avx2:  # float32: packed too, a tied lm_head as its own copy (AVX2; AVX-512 keeps MKL)
        ours = f32_panels.runs_here(load_native())
        assert kinds == ({F32Linear} if ours else {PackedLinear})  # AVX2: ours
        ids = torch.tensor([[3, 17, 99]])
        _within_rounding(
            model.lm_head(model.embed_tokens(ids)),
            model.embed_tokens(ids),
            model.embed_tokens.weight,
            None,
        )
        assert linears(torch.float32, **{"f32-panels": "off"})[2] == {PackedLinear}  # A/B
        monkeypatch.setattr("engine.kernels.cpu.load_native", lambda: None)  # no C kernels: oneDNN
        assert linears(torch.float32)[2] == {PackedLinear}
        monkeypatch.undo()
    else:
        assert kinds == {Linear}
    plain = {"torch-plain": "on"}  # the A/B row: torch's linear on the weights as read
    assert linears(torch.float32, **plain)[2] == {Linear}
    assert linears(torch.bfloat16, **plain)[2] == {Linear}
    model, cfg, kinds = linears(torch.bfloat16)
    if not packing_available(torch.bfloat16, "cpu"):
        assert kinds == {Linear}
        return
    assert kinds == ({Bf16Linear} if _bf16_kernel_here() else {PackedLinear})
    assert linears(torch.bfloat16, **{"bf16-kernel": "off"})[2] == {PackedLinear}  # A/B
    monkeypatch.setattr("engine.kernels.cpu.load_native", lambda: None)  # no C kernels: oneDNN
    assert linears(torch.bfloat16)[2] == {PackedLinear}
    monkeypatch.undo()
    # gathered from: plain
    assert cfg.tie_word_embeddings and model.embed_tokens.weight.layout == torch.strided
    ids = torch.tensor([[3, 17, 99]])
    head = model.lm_head(model.embed_tokens(ids))
    # its own packed copy
    _within_rounding(head, model.embed_tokens(ids), model.embed_tokens.weight, None)

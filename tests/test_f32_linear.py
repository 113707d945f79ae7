"""Our float32 linear kernel (engine/linear/f32_panels.py, engine/kernels/cpu/f32_linear.c): the exact product
within float32's rounding, a row's output bitwise the same alone or in any batch, and the shapes it refuses.
The loader's choice of it is in tests/test_packed_linear.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.kernels.cpu import load_native
from engine.linear import f32_panels
from engine.linear.f32_panels import F32Linear

# SmolLM2-135M's qkv, gate_up, down and lm_head as (in, out); then an input width over two of the kernel's
# 512-wide K blocks and not a multiple of 8, and one of 3
SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152), (1100, 48), (3, 16)]


def _within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """float32 accumulation error over K terms (each bounded by |x||w|) plus one rounding of the result,
    the bound torch's own linear keeps (tests/test_packed_linear.py)."""
    exact = x.double() @ w.double().T
    bound = (
        2**-24 * exact.abs()
        + x.shape[-1] * 2**-23 * (x.double().abs() @ w.double().abs().T)
        + 1e-30
    )
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"worst error {float((err / bound).max()):.2f} x the bound"


@pytest.fixture(scope="module")
def lib():
    lib = load_native()
    if not f32_panels.runs_here(lib):
        pytest.skip(
            "this build has no f32_linear (no AVX2 and FMA here): float32 keeps oneDNN or MKL"
        )
    return lib


def _layer(k: int, n: int, gen: torch.Generator) -> nn.Linear:
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    return lin


def test_the_kernel_is_built_exactly_where_the_cpu_has_avx2_and_fma():
    """The build decides by #if on -march=native: a broken condition would turn the kernel off everywhere
    and let every test below skip."""
    lib = load_native()
    if lib is None:
        pytest.fail("no C compiler: the native kernels could not be built on this machine")
    flags = Path("/proc/cpuinfo").read_text().split()
    assert f32_panels.runs_here(lib) == ("avx2" in flags and "fma" in flags)


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 64, 97, 300])
def test_f32_kernel_is_torch_linear_within_rounding(lib, rows):
    """Row counts around the 6-row tiles and the 96-row blocks, one and two threads, an input that starts
    one float past an alignment, leading dimensions kept."""
    gen = torch.Generator().manual_seed(rows)
    for k, n in SHAPES:
        lin = _layer(k, n, gen)
        assert f32_panels.fits(lin)
        ours = F32Linear(lin, lib)
        x = torch.randn(rows, k, generator=gen)
        got = ours(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        _within_rounding(got, x, lin.weight)
        assert torch.equal(ours(x.reshape(1, rows, k)), got.reshape(1, rows, n))
        odd = torch.empty(rows * k + 1)[1:].view(rows, k)
        odd.copy_(x)
        assert torch.equal(ours(odd), got)
        threads = torch.get_num_threads()
        try:
            for n_threads in (1, 2, 3):  # the panels' split among threads does not change a value
                torch.set_num_threads(n_threads)
                assert torch.equal(ours(x), got)
        finally:
            torch.set_num_threads(threads)


def test_a_rows_output_is_the_same_alone_or_in_any_batch(lib):
    """One FMA chain per output, over k in order, whatever the row count, the row's place in its tile or
    row block, or the K blocks (one block for a single row, 512-wide ones for 200): a request's linear
    layers give it the same rows whoever it is batched with (attention and the rest are not claimed here)."""
    gen = torch.Generator().manual_seed(7)
    lin = _layer(1100, 64, gen)
    ours = F32Linear(lin, lib)
    x = torch.randn(200, 1100, generator=gen)
    batch = ours(x)
    for i in (0, 5, 6, 95, 96, 101, 199):
        assert torch.equal(ours(x[i : i + 1]), batch[i : i + 1]), i
    assert torch.equal(ours(x[3:20]), batch[3:20])
    assert torch.equal(ours(x.flip(0)), batch.flip(0))


def test_f32_kernel_refuses_what_it_cannot_take(lib):
    assert not f32_panels.fits(nn.Linear(64, 48, bias=True))  # a bias: oneDNN's
    assert not f32_panels.fits(nn.Linear(64, 40, bias=False))  # N not a multiple of 16
    assert not f32_panels.fits(nn.Linear(64, 48, bias=False).bfloat16())
    with pytest.raises(ValueError, match="cannot pack a 40 x 64"):
        F32Linear(nn.Linear(64, 40, bias=False), lib)
    ours = F32Linear(nn.Linear(64, 48, bias=False), lib)
    with pytest.raises(TypeError, match="float32"):
        ours(torch.randn(2, 64).bfloat16())
    with pytest.raises(ValueError, match="64 inputs a row, got 65"):
        ours(torch.randn(2, 65))
    assert ours(torch.empty(0, 64)).shape == (0, 48)

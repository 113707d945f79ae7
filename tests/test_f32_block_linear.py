"""The exact float32 mode computed from the GGUF blocks its weights were converted from
(engine/linear/f32_blocks.py, engine/kernels/cpu/f32_block_linear.c): bitwise F32Linear on the
converted weights, for random blocks of every type the kernel reads, for every layer of the embedded model,
and for a whole engine's tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import load_native
from engine.linear import f32_blocks, f32_panels
from engine.model.config import load_hf_config
from engine.linear.f32_blocks import F32BlockLinear
from engine.linear.f32_panels import F32Linear
from engine.model.loader import load_model
from engine.linear.gguf import BLOCK_BYTES, dequantize

LIB = load_native()
pytestmark = pytest.mark.skipif(
    not (f32_blocks.runs_here(LIB) and f32_panels.runs_here(LIB)),
    reason="f32_block_linear needs AVX2, FMA and F16C and a C compiler",
)


def _blocks(kind: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random [n, row bytes] blocks of the type with finite, realistic scales (d > 0, Q4_1's m < 0)."""
    raw = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[kind]), dtype=torch.uint8, generator=gen)
    raw[..., 0:2] = (
        (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4)
        .half()
        .view(torch.uint8)
        .view(n, k // 32, 2)
    )
    if kind == 3:
        m = -torch.rand(n, k // 32, generator=gen) * 0.1
        raw[..., 2:4] = m.half().view(torch.uint8).view(n, k // 32, 2)
    return raw.reshape(n, -1).contiguous()


@pytest.mark.parametrize("kind", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
# 3 panels (an odd one for the pairs), K in blocks
@pytest.mark.parametrize("n,k", [(48, 576), (96, 1536), (16, 800)])
def test_bitwise_f32_linear_on_the_dequantized_weights(kind, n, k):
    gen = torch.Generator().manual_seed(kind * 1000 + n + k)
    blocks = _blocks(kind, n, k, gen)
    weight = dequantize(kind, blocks, k)
    exact = F32Linear(_linear(weight), LIB)
    mine = F32BlockLinear(kind, blocks, (n, k), LIB)
    assert mine.packed.numel() < weight.numel() * 4 / 2  # never held as float32
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            # straight from the blocks (up to 6 rows), buffered beyond
            for m in (
                1,
                2,
                5,
                6,
                7,
                12,
                64,
                100,
            ):
                x = torch.randn(m, k, generator=gen)
                got, want = mine(x), exact(x)
                assert torch.equal(got, want), (m, t, (got - want).abs().max().item())
                torch.testing.assert_close(got, x @ weight.T, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    return layer


def test_shapes_and_types_it_does_not_take_are_refused():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="does not take"):
        F32BlockLinear(3, _blocks(3, 24, 64, gen), (24, 64), LIB)  # 24 rows: not whole panels of 16
    with pytest.raises(ValueError, match="does not take"):
        # Q4_K: not read
        F32BlockLinear(12, torch.zeros(16, 144, dtype=torch.uint8), (16, 256), LIB)
    with pytest.raises(TypeError, match="float32"):
        F32BlockLinear(3, _blocks(3, 16, 64, gen), (16, 64), LIB)(
            torch.zeros(1, 64, dtype=torch.bfloat16)
        )


def _linears(model_dir: str, monkeypatch, blocks: bool) -> dict[str, torch.nn.Module]:
    overrides = {} if blocks else {"f32-blocks": "off"}
    model, _ = load_model(
        model_dir, load_hf_config(model_dir), torch.float32, "cpu", 64, kernel_overrides=overrides
    )
    kept = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (F32Linear, F32BlockLinear, torch.nn.Linear))
    }
    # AVX-512 keeps MKL for plain float32 weights: their panels are packed here, to compare with
    return {n: F32Linear(m, LIB) if isinstance(m, torch.nn.Linear) else m for n, m in kept.items()}


def test_every_layer_of_the_embedded_model_is_bitwise_its_float32_layer(model_dir, monkeypatch):
    floats = _linears(model_dir, monkeypatch, blocks=False)
    mine = _linears(model_dir, monkeypatch, blocks=True)
    assert set(mine) == set(floats) and len(mine) == 30 * 4 + 1  # every layer and the lm_head
    assert all(isinstance(m, F32BlockLinear) for m in mine.values()) and all(
        isinstance(m, F32Linear) for m in floats.values()
    )
    gen = torch.Generator().manual_seed(1)
    for name, layer in mine.items():
        for rows in (1, 9):  # one row straight from the blocks, more buffered
            x = torch.randn(rows, layer.in_features, generator=gen)
            assert torch.equal(layer(x), floats[name](x)), name
    held = sum(m.packed.numel() for m in mine.values())
    # bytes: blocks against float32 panels
    assert held < sum(m.packed.numel() * 4 for m in floats.values()) / 5


class _Rank:
    """A tensor-parallel rank as load_model sees it; its collectives are never called here."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def _never(self, *args):
        raise AssertionError("no collective runs in these layer tests")

    all_reduce_ = ordered_sum = gather_columns = _never


def _rank_linears(model_dir: str, rank: int, blocks: bool) -> dict[str, torch.nn.Module]:
    """A rank's shard of every linear layer (inside its tensor-parallel wrapper), as loaded."""
    overrides = {} if blocks else {"f32-blocks": "off"}
    model, _ = load_model(
        model_dir,
        load_hf_config(model_dir),
        torch.float32,
        "cpu",
        64,
        kernel_overrides=overrides,
        group=_Rank(rank, 2),
    )
    kept = {
        n.removesuffix(".inner"): m
        for n, m in model.named_modules()
        if isinstance(m, (F32Linear, F32BlockLinear, torch.nn.Linear))
    }
    return {n: F32Linear(m, LIB) if isinstance(m, torch.nn.Linear) else m for n, m in kept.items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_block_shard_is_bitwise_its_float_shard(model_dir, rank):
    """Under TP=2 each rank's layers are made from its shard of the blocks (rows of qkv, gate_up and
    the lm_head; whole blocks of columns of o_proj and down_proj): bitwise F32Linear on the same
    shard of the float weights."""
    floats = _rank_linears(model_dir, rank, blocks=False)
    mine = _rank_linears(model_dir, rank, blocks=True)
    assert set(mine) == set(floats) and len(mine) == 30 * 4 + 1
    assert all(isinstance(m, F32BlockLinear) for m in mine.values())
    assert mine["lm_head"].out_features == 49152 // 2
    assert mine["layers.0.self_attn.o_proj"].in_features == (384, 192)[rank]  # its query heads
    gen = torch.Generator().manual_seed(2 + rank)
    for name, layer in mine.items():
        assert (layer.out_features, layer.in_features) == (
            floats[name].out_features,
            floats[name].in_features,
        )
        for rows in (1, 9):
            x = torch.randn(rows, layer.in_features, generator=gen)
            assert torch.equal(layer(x), floats[name](x)), name


def test_the_engine_on_blocks_gives_the_float_panels_tokens_and_logprobs(engine, monkeypatch):
    # wherever the kernel runs (AVX2, FMA and F16C; AVX-512 CPUs too) the embedded model computes from its blocks
    assert engine.server_info["linear_layers"] == ["F32BlockLinear"]
    from engine import Engine

    prompts = ["The capital of France is", "def fib(n):", "Once upon a time, in a land far away,"]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run(eng) -> list:
        # batch 1
        one = [eng.generate(p, params, return_logprob=True, top_logprobs_num=2) for p in prompts]
        # a batch of 12
        many = eng.generate(prompts * 4, params, return_logprob=True, top_logprobs_num=2)
        return [
            (
                o["output_ids"],
                o["meta_info"]["output_token_logprobs"],
                o["meta_info"]["output_top_logprobs"],
            )
            for o in one + many
        ]

    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip(
            "the float panels run on AVX2 CPUs only (AVX-512 keeps MKL, another summation order): "
            "the layers' bitwise test above compares the blocks with them here"
        )
    engine.flush_cache()
    mine = run(engine)
    with Engine(
        dtype="float32", max_total_tokens=4096, kernel_overrides={"f32-blocks": "off"}
    ) as floats:
        assert floats.server_info["linear_layers"] == ["F32Linear"]
        assert run(floats) == mine

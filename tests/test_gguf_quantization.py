"""quantization="gguf": the block kernel against the blocks' own float32 weights, the embedded GGUF read
into our layers (every layer equal to the converted float weights), the engine in that mode against the
exact mode, and the mode's refusals."""

from __future__ import annotations

import pytest
import torch

import test_request_api
from conftest import PROMPTS
from engine import Engine
from engine.bench.quality import (
    greedy_agreement,
    held_out_windows,
    parity_inputs,
    prompt_perplexity,
)
from engine.linear.gguf import (
    BLOCK_BYTES,
    DIRECT_MAX_ROWS,
    GGUFLinear,
    dequantize,
    unpermute_rows,
)
from engine.kernels.cpu import load_native

needs_kernel = pytest.mark.skipif(
    load_native() is None, reason="no C compiler: the GGUF kernel cannot be built"
)


def random_blocks(kind: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Valid blocks: random quants, float16 scales of a realistic size (and mins for Q4_1)."""
    raw = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[kind]), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-4).half().view(torch.uint8)
    raw[..., 0:2] = d
    if kind == 3:
        raw[..., 2:4] = (-torch.rand(n, k // 32, 1, generator=gen) * 0.05).half().view(torch.uint8)
    return raw.reshape(n, -1).contiguous()


def block_mins(kind: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Each weight's block offset m (w = d q + m): Q4_1's stored min, Q4_0's -8 d, Q8_0's 0; [N, k]."""
    raw = blocks.reshape(blocks.shape[0], k // 32, BLOCK_BYTES[kind])
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    m = {2: -8.0 * d, 3: raw[..., 2:4].contiguous().view(torch.float16).float(), 8: 0.0 * d}[kind]
    return m.expand(-1, -1, 32).reshape(-1, k)


def blockwise_x(x: torch.Tensor, steps: float = 32767.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel sees it: each block of 32 rounded to int16 with scale max|x|/32767 (q, scale per block);
    steps=127: to int8 (gguf-q8)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / steps
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(b * inv), d


@needs_kernel
@pytest.mark.parametrize("kind", [2, 3, 8])  # Q4_0, Q4_1, Q8_0
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 12, DIRECT_MAX_ROWS, DIRECT_MAX_ROWS + 1, 200])
@pytest.mark.parametrize(
    "out_features,in_features,bias",
    [(96, 576, False), (7, 64, True), (50, 1536, False), (9, 96, True), (48, 1600, True)],
)
def test_block_layer_matches_its_dequantized_weight(kind, rows, out_features, in_features, bias):
    """Stated tolerances, W the blocks dequantized as gguf's reference does it. The layer multiplies x
    rounded per block of 32 to int16: by the integer kernel below 12 rows, from 12 rows on by the panels
    (widths a multiple of 16: 96, and 48 with bias and K in blocks) and otherwise by the integer kernel up to
    DIRECT_MAX_ROWS rows and float32 GEMMs on dequantized tiles above. Against that x all are exact to
    float32 rounding (1e-5 of the output's scale; the offsets m multiply the float sums of x), and against the
    float x the error stays within the rounding bound sum_k |W_nk| * scale_b(k) / 2."""
    gen = torch.Generator().manual_seed(rows * 31 + kind + in_features)
    blocks = random_blocks(kind, out_features, in_features, gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    layer = GGUFLinear(
        kind, blocks, (out_features, in_features), b, load_native(), torch.get_num_threads()
    )
    weight = dequantize(kind, blocks, in_features)
    # the C dequantizer
    assert torch.allclose(layer.dequantized_weight(), weight, rtol=1e-6, atol=1e-7)
    x = torch.randn(rows, in_features, generator=gen)
    with torch.inference_mode():
        got = layer(x)
    exact = torch.nn.functional.linear(
        x.double(), weight.double(), None if b is None else b.double()
    )
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    q, d = blockwise_x(x)
    seen = (q * d).reshape(rows, in_features).double()
    m = block_mins(kind, blocks, in_features).double()
    want = (
        torch.nn.functional.linear(seen, weight.double() - m, None if b is None else b.double())
        + x.double() @ m.T
    )
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6
    bound = (weight.double() - m).abs() @ (d / 2).expand(-1, -1, 32).reshape(
        rows, in_features
    ).double().T
    assert ((got - exact).abs() <= bound.T * 1.001 + 1e-5).all()
    assert layer(x.reshape(1, rows, in_features)).shape == (1, rows, out_features)


@needs_kernel
@pytest.mark.parametrize(
    "narrower",
    [["-mno-avx512f"], ["-mno-avx512f", "-mno-f16c"], ["-mno-avx2", "-mno-fma", "-mno-avx512f"]],
    ids=["avx2", "avx2-one-block", "scalar"],
)
def test_narrower_instruction_sets_compute_the_same(tmp_path, narrower):
    """The AVX-512 loop (two blocks a step, x reordered to match) is checked against the loops a machine
    without it would build: AVX2 two blocks a step (F16C), AVX2 one block a step, scalar. The same
    rounded x, so equal up to float summation order."""
    import ctypes

    from helpers import build_narrower

    libs = [load_native(), build_narrower(tmp_path, "gguf_linear.c", narrower)]
    for lib in libs:
        lib.gguf_linear.restype = ctypes.c_int
        lib.gguf_linear.argtypes = [
            ctypes.c_int,
            *[ctypes.c_void_p] * 4,
            *[ctypes.c_int64] * 3,
            ctypes.c_int,
        ]
    gen = torch.Generator().manual_seed(7)
    for kind in (2, 3, 8):
        for rows, n, k in ((1, 33, 576), (3, 20, 96), (5, 8, 32), (4, 64, 1536)):
            blocks, x = random_blocks(kind, n, k, gen), torch.randn(rows, k, generator=gen)
            outs = []
            for lib in libs:
                y = torch.empty(rows, n)
                assert (
                    lib.gguf_linear(
                        kind, x.data_ptr(), blocks.data_ptr(), None, y.data_ptr(), rows, n, k, 2
                    )
                    == 0
                )
                outs.append(y)
            assert (outs[0] - outs[1]).abs().max() <= 1e-5 * outs[1].abs().max() + 1e-6, (
                kind,
                rows,
                n,
                k,
            )


@needs_kernel
@pytest.mark.parametrize("kind", [2, 3, 8])  # Q4_0, Q4_1, Q8_0
@pytest.mark.parametrize("out_features,in_features,bias", [(80, 576, False), (48, 1600, True)])
def test_a_block_row_is_bitwise_the_same_in_any_batch_of_12_rows_or_more(
    kind, out_features, in_features, bias
):
    """From 12 rows on (a batch's decode step, prefill) each output is one FMA chain in a fixed order, whatever
    the row count and thread count (1-3: threads with 1 to 5 panels): a prompt's logits do not depend on how
    its rows were batched. Fewer rows go to the integer kernel, which agrees to float32 rounding."""
    gen = torch.Generator().manual_seed(kind + in_features)
    blocks = random_blocks(kind, out_features, in_features, gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    layers = [
        GGUFLinear(kind, blocks, (out_features, in_features), b, load_native(), t)
        for t in (1, 2, 3)
    ]
    assert layers[0].direct_max_rows > 200  # every row count below goes to gguf_panel_linear
    x = torch.randn(200, in_features, generator=gen) * 3
    with torch.inference_mode():
        whole = layers[0](x)
        for layer in layers:
            for rows in (12, 13, 16, 17, 23, 64, 97, 200):
                assert torch.equal(layer(x[:rows]), whole[:rows]), (layer._threads, rows)
            for i in (0, 57, 199):  # one row among 12 copies of it
                assert torch.equal(
                    layer(x[i : i + 1].expand(12, -1).contiguous()), whole[i : i + 1].expand(12, -1)
                )
        few = torch.cat([layers[1](x[i : i + 5]) for i in range(0, 200, 5)])  # the integer kernel
    assert (few - whole).abs().max() <= 1e-5 * whole.abs().max() + 1e-6


def _want(
    kind: int,
    blocks: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    steps: float = 32767.0,
) -> torch.Tensor:
    """The layer's definition in float64: x rounded per block to int16 steps (or `steps`) times d q, plus m sum(x)."""
    k = x.shape[1]
    weight, m = dequantize(kind, blocks, k).double(), block_mins(kind, blocks, k).double()
    q, d = blockwise_x(x, steps)
    seen = (q * d).reshape(x.shape).double()
    return (
        torch.nn.functional.linear(seen, weight - m, None if bias is None else bias.double())
        + x.double() @ m.T
    )


@needs_kernel
@pytest.mark.parametrize("kind", [2, 3, 8])
@pytest.mark.parametrize(
    "out_features,in_features,rows,threads",
    [
        (48, 1600, 20, 2),  # K in blocks, then the offsets' columns
        (16, 32 * 769, 12, 2),  # 769 blocks: the offsets' columns in two chunks of at most 768
        (32, 96, 20, 3),  # more threads than panels: one thread has none
    ],
)
def test_block_panels_where_the_offsets_weigh(kind, out_features, in_features, rows, threads):
    """One large value in each block of 32 makes the other 31 round coarsely, so the rounded x's sums differ
    from x's and the offsets' extra columns (m times that residue) carry a visible part of the output: a
    residue matched to the wrong block, or left out, fails here (Q8_0 has no offsets: the plain path)."""
    gen = torch.Generator().manual_seed(kind * 7 + in_features)
    blocks = random_blocks(kind, out_features, in_features, gen)
    bias = torch.randn(out_features, generator=gen)
    layer = GGUFLinear(kind, blocks, (out_features, in_features), bias, load_native(), threads)
    x = torch.randn(rows, in_features, generator=gen)
    x[:, ::32] *= 3e3
    with torch.inference_mode():
        got = layer(x)
    want = _want(kind, blocks, x, bias)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6
    if kind != 8:  # without the residue the error would be far beyond that bound
        weight = dequantize(kind, blocks, in_features).double()
        q, d = blockwise_x(x)
        seen = (q * d).reshape(x.shape).double()
        no_residue = torch.nn.functional.linear(seen, weight, bias.double())
        assert (no_residue - want).abs().max() > 5 * (got - want).abs().max()


@needs_kernel
def test_without_avx2_block_layers_keep_the_integer_kernel_to_few_rows(tmp_path):
    """A build without AVX2, FMA and F16C runs gguf_panel_linear as gguf_linear at every row count (built so
    here, and compared), and a layer whose library says so multiplies dequantized tiles beyond
    DIRECT_MAX_ROWS rows, as layers of other widths do."""
    import ctypes

    from helpers import ScalarBuild, build_narrower

    narrow = build_narrower(
        tmp_path,
        ["gguf_panel_linear.c", "gguf_linear.c", "gguf_q8_linear.c", "f32_linear.c"],
        ["-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f"],
    )
    narrow.gguf_panel_linear.argtypes = [
        ctypes.c_int,
        *[ctypes.c_void_p] * 4,
        *[ctypes.c_int64] * 3,
        ctypes.c_int,
    ]
    assert narrow.gguf_panel_vectorized() == 0
    gen = torch.Generator().manual_seed(11)
    blocks, x = random_blocks(3, 32, 96, gen), torch.randn(20, 96, generator=gen)
    fast = GGUFLinear(3, blocks, (32, 96), None, load_native(), 2)
    y = torch.empty(20, 32)
    assert (
        narrow.gguf_panel_linear(
            3, x.data_ptr(), blocks.data_ptr(), None, y.data_ptr(), 20, 32, 96, 2
        )
        == 0
    )
    with torch.inference_mode():
        want = fast(x)
    assert (y - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6

    layer = GGUFLinear(
        3, blocks, (32, 96), None, ScalarBuild(load_native(), "gguf_panel_vectorized"), 2
    )
    assert layer.direct_max_rows == DIRECT_MAX_ROWS
    x = torch.randn(DIRECT_MAX_ROWS + 20, 96, generator=gen)
    with torch.inference_mode():
        got, panels = layer(x), fast(x)
    assert (got - panels).abs().max() <= 1e-5 * panels.abs().max() + 1e-6


@needs_kernel
def test_a_block_layer_bigger_than_the_scratch_buffer_runs_in_tiles(monkeypatch):
    import engine.linear.quantized as linear

    # tiles of 7 output rows, the last one short
    monkeypatch.setattr(linear, "SCRATCH_MAX_ELEMENTS", 64 * 7)
    gen = torch.Generator().manual_seed(5)
    blocks = random_blocks(3, 45, 64, gen)
    layer = GGUFLinear(3, blocks, (45, 64), None, load_native(), 1)
    x = torch.randn(DIRECT_MAX_ROWS + 30, 64, generator=gen)
    with torch.inference_mode():
        got = layer(x)  # tiles of 7 rows
    monkeypatch.setattr(linear, "SCRATCH_MAX_ELEMENTS", 1 << 22)
    with torch.inference_mode():
        whole = layer._dequantized_matmul(x)  # one tile
    assert (got - whole).abs().max() <= 1e-5 * whole.abs().max() + 1e-6


def test_unpermute_rows_inverts_llama_cpp_permutation():
    """llama.cpp's converter writes q as w.reshape(H, 2, D/2, K).swapaxes(1, 2): our order undoes it."""
    heads, d, k = 3, 8, 5
    w = torch.arange(heads * d * k, dtype=torch.float32).reshape(heads * d, k)
    stored = w.reshape(heads, 2, d // 2, k).swapaxes(1, 2).reshape(heads * d, k)
    assert torch.equal(stored[unpermute_rows(heads * d, heads)], w)


@needs_kernel
def test_embedded_gguf_blocks_are_the_converted_weights(model_dir):
    """Every linear layer read from the GGUF, dequantized, equals the float32 weights the exact mode loads
    from the converted directory (q and k in the right row order, gate/up and q/k/v stacked right)."""
    from engine.model.config import model_config_from_hf
    from engine.model.llama import LlamaForCausalLM, weight_plan
    from engine.model.loader import index_weights, read_planned
    from engine.quantization import linear_shapes
    from engine.linear.gguf import read_blocks
    from transformers import AutoConfig

    cfg = model_config_from_hf(AutoConfig.from_pretrained(model_dir), model_dir)
    with torch.device("meta"):
        shapes = linear_shapes(LlamaForCausalLM(cfg, torch.empty(1), torch.empty(1)))
    entries = index_weights(model_dir)
    plan = weight_plan(cfg, set(entries))
    floats = read_planned(plan, entries, torch.float32)
    blocks = read_blocks(model_dir, cfg, shapes, floats)
    assert set(blocks) == set(shapes)
    for name, (kind, data) in blocks.items():
        source = floats[
            "embed_tokens.weight"
            if name == "lm_head" and cfg.tie_word_embeddings
            else f"{name}.weight"
        ]
        got = dequantize(kind, data, shapes[name][1])
        assert torch.allclose(got, source, rtol=1e-6, atol=1e-7), name
    # Q4_1 layers, the Q8_0 embedding as lm_head
    assert {kind for kind, _ in blocks.values()} == {
        3,
        8,
    }


@pytest.fixture(scope="module")
def gguf_engine():
    # a chunked prompt of 964 tokens
    eng = Engine(quantization="gguf", max_total_tokens=8192, chunked_prefill_size=512)
    try:
        yield eng
    finally:
        eng.shutdown()


@needs_kernel
def test_gguf_engine_reports_its_mode(gguf_engine):
    assert (
        gguf_engine.server_info["quantization"] == "gguf"
        and gguf_engine.server_info["dtype"] == "float32"
    )


@needs_kernel
def test_gguf_quality_against_the_exact_weights(engine, gguf_engine, tokenizer):
    """The exact engine is the session's float32 one, whose weights are these blocks dequantized; what
    differs is the activations, rounded per block of 32 to int16. Perplexity on held-out text within
    0.5% (measured: 0.00% on 4,088 tokens), and greedy outputs mostly identical (measured on the parity
    prompts: 7 of 8 identical over 64 tokens)."""
    windows = held_out_windows(tokenizer, 2, 256)
    (exact, _), (blocks, _) = (
        prompt_perplexity(engine, windows),
        prompt_perplexity(gguf_engine, windows),
    )
    assert abs(blocks / exact - 1) <= 0.005, (exact, blocks)
    share = greedy_agreement(engine, gguf_engine, parity_inputs(tokenizer), 32)
    assert share["identical_outputs"] >= 5 and share["token_agreement"] >= 0.75, share


@needs_kernel
@pytest.mark.parametrize(
    "check",
    [
        "test_seeded_request_is_reproducible_in_any_batch",
        "test_stop_strings_spanning_tokens",
        "test_n_samples_share_one_prefill",
        "test_streaming_equals_non_streaming",
        "test_abort_frees_memory",
        "test_n_samples_of_a_chunked_prompt_share_its_prefill",
    ],
)
def test_request_api_on_gguf(gguf_engine, tokenizer, check):
    fn = getattr(test_request_api, check)
    fn(gguf_engine, tokenizer) if "tokenizer" in fn.__code__.co_varnames[
        : fn.__code__.co_argcount
    ] else fn(gguf_engine)


def assert_greedy_agrees_but_at_a_tie(cold: dict, warm: dict, tie: float = 0.01) -> int:
    """The two greedy outputs are the same tokens with the same logprobs (within 0.01) up to the first
    place they part, and there the cold run's two best tokens were within `tie` nats of each other: a
    near-tie that a float32 rounding may break either way. Returns how many tokens agreed."""
    cold_top, warm_top = (
        cold["meta_info"]["output_top_logprobs"],
        warm["meta_info"]["output_top_logprobs"],
    )
    for i, (a, b) in enumerate(zip(cold["output_ids"], warm["output_ids"])):
        if a != b:
            gap = cold_top[i][0][0] - cold_top[i][1][0]
            assert gap < tie, (
                f"token {i}: {a} cold against {b} warm, not a near-tie (gap {gap:.4f} nats)"
            )
            return i
        assert cold_top[i][0][0] == pytest.approx(warm_top[i][0][0], abs=0.01), (
            f"token {i}'s logprob"
        )
    assert len(cold["output_ids"]) == len(warm["output_ids"])
    return len(cold["output_ids"])


@needs_kernel
def test_gguf_prefix_cache_reuses_and_matches(gguf_engine, tokenizer):
    """A cached prefix gives what the cold run gave. Not bitwise: the cold run's long prompt goes through
    the dequantized matmul (more than DIRECT_MAX_ROWS rows) and the warm run's one recomputed token
    through the block kernel with int16 activations, so the last prompt token's logits differ by
    roundings, and " Why?"'s first token is a near-tie here (top two 0.0007 nats apart on an AMD EPYC
    with AVX-512): an AVX2 machine's roundings broke it the other way (CI, 2026-12-02). So tokens
    agree up to a near-tie, logprobs within 0.01, and most tokens must be compared."""
    shared = tokenizer.encode(" ".join(PROMPTS) * 2)
    prompts = [shared + tokenizer.encode(q) for q in (" Why?", " How so?", " Go on.")]
    params = {"max_new_tokens": 12, "temperature": 0}
    logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    cold = [gguf_engine.generate(input_ids=p, sampling_params=params, **logprobs) for p in prompts]
    warm = gguf_engine.generate(input_ids=prompts, sampling_params=params, **logprobs)
    agreed = [assert_greedy_agrees_but_at_a_tie(c, w) for c, w in zip(cold, warm)]
    assert sum(agreed) >= 24, f"too few tokens compared: {agreed}"
    assert all(o["meta_info"]["cached_tokens"] >= len(shared) - 1 for o in warm)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"quantization": "gguf", "dtype": "bfloat16"}, "computes in float32"),
        ({"quantization": "gguf", "device": "cuda"}, "CPU only"),
        ({"quantization": "gguf", "model_path": "some/hf-directory"}, "is not a .gguf file"),
    ],
)
def test_bad_gguf_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(**kwargs)


def test_a_directory_not_made_from_a_gguf_is_refused(tmp_path, model_dir):
    """A converted directory copied elsewhere has no GGUF behind it: refused by path in the user process,
    and by the reader (what the scheduler's start reports) naming why."""
    import shutil

    from engine.linear.gguf import gguf_source, read_blocks

    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns(".complete"))
    assert gguf_source(model_dir) is not None and gguf_source(str(copy)) is None
    with pytest.raises(ValueError, match="is not a .gguf file"):
        Engine(model_path=str(copy), quantization="gguf")
    with pytest.raises(ValueError, match="needs a model loaded from a .gguf file"):
        read_blocks(str(copy), None, {}, {})


def test_our_gguf_index_reads_what_ggufs_reader_reads():
    """engine/model/gguf_file.py against the gguf package's GGUFReader on the embedded file: every tensor's
    type, dims and (for the block types) raw bytes."""
    import gguf

    from engine.model.embedded import embedded_gguf_path
    from engine.model.gguf_file import read_index, read_tensor

    path = embedded_gguf_path()
    ours = read_index(path)
    theirs = gguf.GGUFReader(str(path)).tensors
    assert set(ours) == {t.name for t in theirs}
    for t in theirs:
        mine = ours[t.name]
        assert (mine.kind, list(mine.dims)) == (int(t.tensor_type), [int(d) for d in t.shape]), (
            t.name
        )
        if mine.kind in BLOCK_BYTES:
            raw = read_tensor(path, mine, mine.dims[0] // 32 * BLOCK_BYTES[mine.kind])
            assert torch.equal(raw, torch.from_numpy(t.data.copy())), t.name


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    from engine.model.gguf_file import read_index

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ValueError, match="broken.gguf is not a readable GGUF file"):
        read_index(bad)
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_index(bad)


def _tiny_gguf(tmp_path, permuted: bool):
    """A two-layer GGUF of Q8_0 tensors (gguf's own writer and quantizer), with the float reference the
    converted directory would hold for layer 0's qkv, and the model directory marked as made from it."""
    import gguf
    import numpy as np

    from engine.model.config import ModelConfig

    heads, kv_heads, d, hidden, inter, vocab = 2, 1, 32, 64, 96, 64
    cfg = ModelConfig(
        "llama",
        vocab,
        hidden,
        inter,
        2,
        heads,
        kv_heads,
        d,
        1e-5,
        True,
        False,
        False,
        False,
        128,
        (0,),
    )
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    shapes = {
        "attn_q": (heads * d, hidden),
        "attn_k": (kv_heads * d, hidden),
        "attn_v": (kv_heads * d, hidden),
        "attn_output": (hidden, heads * d),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    floats = {}
    for i in range(2):
        for name, shape in shapes.items():
            w = rng.standard_normal(shape).astype(np.float32)
            floats[f"{i}.{name}"] = w
            stored = w
            if permuted and name in ("attn_q", "attn_k"):
                h = heads if name == "attn_q" else kv_heads
                stored = w.reshape(h, 2, shape[0] // h // 2, shape[1]).swapaxes(1, 2).reshape(shape)
            q = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                f"blk.{i}.{name}.weight",
                q,
                raw_shape=q.shape,
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
    emb = gguf.quants.quantize(
        rng.standard_normal((vocab, hidden)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor(
        "token_embd.weight", emb, raw_shape=emb.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model_dir = tmp_path / "converted"
    model_dir.mkdir()
    (model_dir / ".complete").write_text(str(tmp_path / "tiny.gguf"))
    qkv = np.concatenate([floats["0.attn_q"], floats["0.attn_k"], floats["0.attn_v"]])
    reference = {
        "layers.0.self_attn.qkv_proj.weight": dequantize(
            8, torch.from_numpy(gguf.quants.quantize(qkv, gguf.GGMLQuantizationType.Q8_0)), hidden
        )
    }
    linear = {
        "self_attn.qkv_proj": ((heads + 2 * kv_heads) * d, hidden),
        "self_attn.o_proj": (hidden, heads * d),
        "mlp.gate_up_proj": (2 * inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    shapes_ours = {f"layers.{i}.{k}": v for i in range(2) for k, v in linear.items()} | {
        "lm_head": (vocab, hidden)
    }
    return str(model_dir), cfg, shapes_ours, reference, floats


@pytest.mark.parametrize("permuted", [True, False])
def test_q_and_k_rows_in_either_order_are_read_into_ours(tmp_path, permuted):
    """llama.cpp permutes q/k rows for Llama; other architectures' files keep them as stored. Both come out
    in our order in every layer (not only the first, which decides the order)."""
    from engine.linear.gguf import read_blocks

    model_dir, cfg, shapes, reference, floats = _tiny_gguf(tmp_path, permuted)
    blocks = read_blocks(model_dir, cfg, shapes, reference)
    for i in range(2):
        kind, data = blocks[f"layers.{i}.self_attn.qkv_proj"]
        got = dequantize(kind, data, 64)
        want = torch.from_numpy(
            __import__("numpy").concatenate(
                [floats[f"{i}.attn_q"], floats[f"{i}.attn_k"], floats[f"{i}.attn_v"]]
            )
        )
        assert torch.allclose(got, want, atol=0.05), i  # Q8_0 rounding


def test_a_truncated_gguf_is_refused_naming_the_tensor(tmp_path):
    from engine.linear.gguf import read_blocks

    model_dir, cfg, shapes, reference, _ = _tiny_gguf(tmp_path, True)
    path = tmp_path / "tiny.gguf"
    path.write_bytes(path.read_bytes()[:-4000])
    with pytest.raises(ValueError, match="tiny.gguf: tensor .* lies outside the file"):
        read_blocks(model_dir, cfg, shapes, reference)


def test_a_zero_alignment_is_refused(tmp_path):
    import gguf

    from engine.model.gguf_file import read_index

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    writer.add_uint32("general.alignment", 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="odd.gguf is not a readable GGUF file.*alignment 0"):
        read_index(tmp_path / "odd.gguf")


@needs_kernel
def test_the_bound_kernel_follows_its_weights_when_they_move():
    """kernel_call binds the weights' addresses once; a layer whose blocks are replaced (what .to() does)
    computes with the new ones, not with freed memory."""
    gen = torch.Generator().manual_seed(3)
    layer = GGUFLinear(3, random_blocks(3, 16, 64, gen), (16, 64), None, load_native(), 2)
    x = torch.randn(1, 64, generator=gen)
    before = layer(x)
    other = random_blocks(3, 16, 64, gen)
    layer.blocks = other
    want = torch.nn.functional.linear(x, dequantize(3, other, 64))
    got = layer(x)
    assert not torch.allclose(got, before) and torch.allclose(got, want, rtol=1e-3, atol=1e-3)


@needs_kernel
def test_the_bound_kernel_follows_weights_moved_by_apply():
    """.to(), .float() and the like replace buffers through _apply, not through attribute assignment."""
    gen = torch.Generator().manual_seed(5)
    layer = GGUFLinear(3, random_blocks(3, 16, 64, gen), (16, 64), None, load_native(), 2)
    x = torch.randn(1, 64, generator=gen)
    layer(x)
    other = random_blocks(3, 16, 64, gen)
    layer._apply(lambda t: other if t is layer.blocks else t)
    assert layer.blocks is other
    assert torch.allclose(
        layer(x), torch.nn.functional.linear(x, dequantize(3, other, 64)), rtol=1e-3, atol=1e-3
    )
    layer.register_buffer("blocks", random_blocks(3, 16, 64, gen))
    assert torch.allclose(
        layer(x),
        torch.nn.functional.linear(x, dequantize(3, layer.blocks, 64)),
        rtol=1e-3,
        atol=1e-3,
    )


@needs_kernel
def test_the_bound_kernel_follows_a_replaced_bias():
    gen = torch.Generator().manual_seed(4)
    blocks = random_blocks(3, 16, 64, gen)
    layer = GGUFLinear(3, blocks, (16, 64), torch.zeros(16), load_native(), 2)
    x = torch.randn(1, 64, generator=gen)
    base = layer(x)
    layer.bias = torch.full((16,), 2.0)
    assert torch.allclose(layer(x), base + 2.0, atol=1e-5)

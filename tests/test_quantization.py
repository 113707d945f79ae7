"""quantization="int8": the int8 layer against float32, the quantized engine on the request-API, prefix-cache
and plugin checks that do not compare with transformers token for token, its quality against the exact
weights, the on-disk cache of quantized weights, and the option's bad values."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import test_plugins
import test_request_api
from conftest import PROMPTS
from engine import Engine
from engine.bench.quality import (
    greedy_agreement,
    held_out_windows,
    parity_inputs,
    prompt_perplexity,
)
from engine.hooks.loader import unload_plugins
from engine.linear.int8 import DIRECT_MAX_ROWS, Int8Linear, panels, quantize_rows, rows_of
from engine.kernels.cpu import load_native

needs_kernel = pytest.mark.skipif(
    load_native() is None, reason="no C compiler: the int8 kernel cannot be built"
)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, DIRECT_MAX_ROWS, DIRECT_MAX_ROWS + 1, 300])
@pytest.mark.parametrize(
    "out_features,in_features,bias",
    [
        (960, 576, False),
        (48, 41, True),
        (32, 1600, False),  # in panels: 1,600 in blocks of K
        (45, 40, True),
        (8, 1536, True),
        (44, 41, True),  # row-major; 41: the scalar path
    ],
)
def test_int8_layer_matches_float32(rows, out_features, in_features, bias):
    """Stated tolerances: against its own dequantized weight the layer is exact to float32 rounding
    (1e-4 relative to the output's scale); against the float32 layer the error stays within the
    rounding bound sum_k |x_k| * scale_n / 2 of each output."""
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    layer = Int8Linear(linear.weight, linear.bias, load_native(), torch.get_num_threads())
    x = torch.randn(rows, in_features, generator=gen)
    with torch.inference_mode():
        got = layer(x)
        exact = linear(x)
        own = torch.nn.functional.linear(x, layer.dequantized_weight(), linear.bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert (got - own).abs().max() <= 1e-4 * own.abs().max() + 1e-5
    bound = x.abs() @ (layer.scale / 2).expand(in_features, -1)
    assert ((got - exact).abs() <= bound * 1.001 + 1e-5).all()
    # any leading shape
    assert layer(x.reshape(1, rows, in_features)).shape == (
        1,
        rows,
        out_features,
    )


@needs_kernel
@pytest.mark.parametrize(
    "out_features,in_features,bias", [(960, 576, False), (80, 200, False), (48, 1600, True)]
)
def test_an_int8_row_is_bitwise_the_same_alone_or_in_any_batch(out_features, in_features, bias):
    """Weights in panels: every row count (one and two rows over several panels at once, tiles converting in
    registers, the buffered many-row path, blocks of K) and thread count (1-3: threads with 1 to 60 panels)
    gives each row the same bits, so batching and the prefix cache cannot change a greedy int8 output."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
    layers = [
        Int8Linear(linear.weight, linear.bias, load_native(), threads) for threads in (1, 2, 3)
    ]
    assert layers[0].in_panels and layers[0].qweight.shape == (out_features // 16, in_features, 16)
    assert layers[0].direct_max_rows > 100  # every row count below goes to the panel kernel
    x = torch.randn(100, in_features, generator=gen)
    with torch.inference_mode():
        alone = torch.cat([layers[0](x[i : i + 1]) for i in range(x.shape[0])])
        for layer in layers:
            for rows in (1, 2, 3, 5, 7, 15, 16, 64, 100):
                assert torch.equal(layer(x[:rows]), alone[:rows]), (layer._threads, rows)
    layer = layers[1]
    untouched = torch.full((2, out_features), 7.0)  # no rows: nothing written
    bias_ptr = None if linear.bias is None else layer.bias.data_ptr()
    assert (
        load_native().int8_panel_linear(
            x.data_ptr(),
            layer.qweight.data_ptr(),
            layer.scale.data_ptr(),
            bias_ptr,
            untouched.data_ptr(),
            0,
            out_features,
            in_features,
            2,
        )
        == 0
    )
    assert (untouched == 7.0).all()


@needs_kernel
def test_without_avx2_the_panel_kernel_is_kept_to_few_rows():
    """A build without AVX2 runs int8_panel_linear as a scalar loop: the layer then multiplies dequantized
    tiles (from its panels) beyond DIRECT_MAX_ROWS rows, as row-major layers do. The real library, with only
    its answer to that question changed."""

    from helpers import ScalarBuild

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen) * 0.05
    layer = Int8Linear(
        weight, None, ScalarBuild(load_native(), "int8_panel_vectorized"), torch.get_num_threads()
    )
    assert layer.in_panels and layer.direct_max_rows == DIRECT_MAX_ROWS
    x = torch.randn(DIRECT_MAX_ROWS + 20, 64, generator=gen)
    with torch.inference_mode():
        got, own = layer(x), torch.nn.functional.linear(x, layer.dequantized_weight())
    assert (got - own).abs().max() <= 1e-4 * own.abs().max() + 1e-5


def test_row_major_int8_weights_are_requantized_for_a_panel_layer():
    """A cache of the format before panels holds [N, K] weights: a layer of a width in panels does not take
    them (quantizes again), and says so where its float weight was never loaded."""
    weight = torch.randn(48, 20)
    q, scale = quantize_rows(weight)
    layer = Int8Linear(weight, None, None, 1, (q, scale))
    assert layer.qweight.shape == (3, 20, 16) and torch.equal(rows_of(layer.qweight, 48, 20), q)
    with pytest.raises(ValueError, match="do not fit"):
        Int8Linear(torch.empty(48, 20, device="meta"), None, None, 1, (q, scale))


def test_int8_panels_hold_the_row_major_weights():
    q = torch.randint(-127, 128, (48, 20), dtype=torch.int8)
    stored = panels(q)
    assert stored.shape == (3, 20, 16) and stored[1, 5, 7] == q[16 + 7, 5]
    assert torch.equal(rows_of(stored, 48, 20), q)
    weight = torch.randn(48, 20)
    layer = Int8Linear(weight, None, None, 1)  # no kernel needed to dequantize
    rows, scale = quantize_rows(weight)
    assert torch.equal(layer.dequantized_weight(), rows.float() * scale[:, None])
    part = torch.empty(37 - 5, 20)
    layer._dequantize_into(5, 37, part)  # rows across three panels, neither end on a panel's edge
    assert torch.equal(part, rows[5:37].float() * scale[5:37, None])


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_a_layer_bigger_than_the_scratch_buffer_runs_in_tiles(monkeypatch, bias):
    import engine.linear.quantized as linear

    # tiles of 7 output rows, the last one short
    monkeypatch.setattr(linear, "SCRATCH_MAX_ELEMENTS", 40 * 7)
    linear = torch.nn.Linear(40, 45, bias=bias)
    layer = Int8Linear(linear.weight, linear.bias, load_native(), torch.get_num_threads())
    x = torch.randn(DIRECT_MAX_ROWS + 30, 40)
    with torch.inference_mode():
        got = layer(x)
        own = torch.nn.functional.linear(x, layer.dequantized_weight(), linear.bias)
    assert (got - own).abs().max() <= 1e-4 * own.abs().max() + 1e-5


def test_cached_weights_of_the_wrong_dtype_are_requantized():
    weight = torch.randn(8, 16)
    q, scale = quantize_rows(weight)
    layer = Int8Linear(weight, None, load_native(), 1, (q, scale.to(torch.bfloat16)))
    assert layer.scale.dtype == torch.float32 and torch.equal(layer.qweight, q)


def test_quantize_rows_round_trip():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -3.0]])
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.allclose(q.float() * scale[:, None], w, atol=float(scale.max()) / 2)
    assert not q[1].any()  # an all-zero row stays zero (no division by zero)


@pytest.fixture(scope="module")
def int8_engine(tmp_path_factory):
    """One int8 engine with the test plugins loaded, for the plugin checks and the request-API ones."""
    path = tmp_path_factory.mktemp("probe-int8") / "events.jsonl"
    os.environ["ENGINE_TEST_PROBE"] = str(path)
    # chunks of 512: the request-API check of a chunked prompt then prefills 964 tokens, not 2,500
    eng = Engine(
        quantization="int8",
        max_total_tokens=8192,
        chunked_prefill_size=512,
        plugins=test_plugins.PLUGIN + ",no_repeat_ngram",
    )
    try:
        yield eng, path
    finally:
        eng.shutdown()
        unload_plugins([test_plugins.PLUGIN, "no_repeat_ngram"])
        os.environ.pop("ENGINE_TEST_PROBE", None)


@needs_kernel
def test_int8_engine_reports_its_mode(int8_engine):
    eng, _ = int8_engine
    assert eng.server_info["quantization"] == "int8" and eng.server_info["dtype"] == "float32"


@needs_kernel
@pytest.mark.parametrize(
    "check",
    [
        "test_seeded_request_is_reproducible_in_any_batch",
        "test_stop_strings_spanning_tokens",
        "test_min_new_tokens_suppresses_eos",
        "test_n_samples_share_one_prefill",
        "test_streaming_equals_non_streaming",
        "test_async_generate_and_async_stream",
        "test_abort_frees_memory",
        "test_custom_processor_bans_tokens",
        "test_force_token_after",
        "test_logit_bias_forces_a_token",
        "test_prompt_logprobs_from_a_start_position_bypass_the_cache",
        "test_n_samples_of_a_chunked_prompt_share_its_prefill",
    ],
)
def test_request_api_on_int8(int8_engine, tokenizer, check):
    fn = getattr(test_request_api, check)
    eng, _ = int8_engine
    fn(eng, tokenizer) if "tokenizer" in fn.__code__.co_varnames[: fn.__code__.co_argcount] else fn(
        eng
    )


@needs_kernel
@pytest.mark.parametrize(
    "check",
    [
        "test_rewrite_prompt_hook_changes_the_output",
        "test_logits_hook_changes_sampling",
        "test_failing_hook_fails_only_its_requests",
        "test_plugin_provides_a_logit_processor",
    ],
)
def test_plugins_on_int8(int8_engine, tokenizer, check):
    fn = getattr(test_plugins, check)
    fn(int8_engine, tokenizer) if "tokenizer" in fn.__code__.co_varnames[
        : fn.__code__.co_argcount
    ] else fn(int8_engine)


@needs_kernel
def test_int8_prefix_cache_reuses_and_matches(int8_engine, tokenizer):
    eng, _ = int8_engine
    shared = tokenizer.encode(" ".join(PROMPTS) * 2)
    prompts = [shared + tokenizer.encode(q) for q in (" Why?", " How so?", " Name one.")]
    params = {"max_new_tokens": 12, "temperature": 0}
    cold = [eng.generate(input_ids=p, sampling_params=params) for p in prompts]
    warm = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in warm] == [o["output_ids"] for o in cold]
    assert all(o["meta_info"]["cached_tokens"] >= len(shared) - 1 for o in warm)
    # the second cold request reused the first's
    assert cold[1]["meta_info"]["cached_tokens"] >= len(shared) - 1


@needs_kernel
def test_int8_quality_against_the_exact_weights(engine, int8_engine, tokenizer):
    """The exact engine is the session's float32 one. Perplexity within 2% (the target; measured 0.3% on
    4,088 tokens), and greedy outputs that start alike (measured: a third identical over 64 tokens)."""
    eng, _ = int8_engine
    windows = held_out_windows(tokenizer, 2, 256)
    (exact, _), (quantized, _) = prompt_perplexity(engine, windows), prompt_perplexity(eng, windows)
    assert abs(quantized / exact - 1) <= 0.02, (exact, quantized)
    share = greedy_agreement(engine, eng, parity_inputs(tokenizer), 32)
    assert share["mean_identical_prefix"] >= 4 and share["identical_outputs"] >= 1, share


@needs_kernel
def test_int8_weights_come_back_from_the_cache(tmp_path, monkeypatch, model_dir):
    """The second start reads the int8 weights back (same outputs); a damaged cache file is rebuilt.
    A private cache directory, and the converted model by path (so nothing but the kernels and the int8
    weights is built there: the kernels are this session's library, copied in)."""
    from engine.kernels.cpu import build

    built = build.cached_library()  # the session engine's build
    if built.exists() and build.unsafe_reason(built) is None:
        (tmp_path / "kernels").mkdir(mode=0o700)
        shutil.copy2(built, tmp_path / "kernels" / built.name)
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    from engine.quantization.cache import cache_file

    params = {"max_new_tokens": 8, "temperature": 0}
    options = {"model_path": model_dir, "quantization": "int8", "max_total_tokens": 1024}
    with Engine(**options) as first:
        expected = first.generate(PROMPTS[7], params)["output_ids"]
    path = cache_file(model_dir, "int8")
    assert path.exists() and path.stat().st_size > 0
    stamp = path.stat().st_mtime_ns
    with Engine(**options) as second:
        assert second.generate(PROMPTS[7], params)["output_ids"] == expected
    assert path.stat().st_mtime_ns == stamp  # read, not rewritten
    path.write_bytes(b"not safetensors")
    with Engine(**options) as third:
        assert third.generate(PROMPTS[7], params)["output_ids"] == expected
    assert path.stat().st_size > 100


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"quantization": "int4"}, "quantization must be one of"),
        ({"quantization": None}, "quantization must be one of"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "computes in float32"),
        ({"quantization": "int8", "device": "cuda"}, "CPU only"),
    ],
)
def test_bad_quantization_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(**kwargs)


def test_quantization_checks_name_the_machine_problem(monkeypatch):
    from engine.quantization import check_quantization

    check_quantization("none", "cuda", torch.bfloat16)  # the exact mode runs anywhere
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", "cuda", torch.float32)
    with pytest.raises(ValueError, match="float32"):
        check_quantization("int8", "cpu", torch.bfloat16)
    monkeypatch.setattr("engine.kernels.cpu.load_native", lambda: None)
    with pytest.raises(ValueError, match="C kernel"):
        check_quantization("int8", "cpu", torch.float32)

"""The exact mode in bfloat16 (a choice on the CPU; `auto` is float32 there) against transformers in
bfloat16, and its native elementwise kernels against the torch operations they replace.

Greedy runs in bfloat16 part ways wherever two logits tie within bfloat16's resolution, so the check is
teacher-forced: transformers scores the engine's own greedy continuation, and at each position its
argmax must be the engine's token, or, where not, within a rounding of it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from engine.kernels import ops
from engine.kernels.cpu import load_native

NEW_TOKENS = 64


def _torch_rms_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * w.float()).to(x.dtype)


@pytest.mark.parametrize("rows", [1, 64, 700])  # 700 x 576: above the kernels' threading threshold
def test_native_bf16_elementwise_matches_torch(rows):
    if load_native() is None:
        pytest.fail("no C compiler: the native kernels could not be built on this machine")
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=gen) * 3).bfloat16()
    delta = torch.randn(rows, 576, generator=gen).bfloat16()
    w = torch.randn(576, generator=gen).bfloat16()
    want_h = h + delta
    want = _torch_rms_norm(want_h, w, 1e-5)
    got_h, got = ops.add_rms_norm(h.clone(), delta, w, 1e-5)
    assert torch.equal(got_h, want_h)  # the residual add: the same rounding
    ulps = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    # float32 sum order: one ulp, rarely
    assert ulps.max() <= 2**-7 and (got != want).float().mean() < 1e-3
    assert torch.equal(ops.rms_norm(want_h, w, 1e-5), got)

    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 3).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_and_mul(gate_up)
    assert (got != want).float().mean() < 1e-3
    assert ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs() + 1e-30).all()

    qkv = torch.randn(rows, (9 + 2 * 3) * 64, generator=gen).bfloat16()
    cos, sin = (
        torch.randn(rows, 64, generator=gen).bfloat16(),
        torch.randn(rows, 64, generator=gen).bfloat16(),
    )
    q, k, v = qkv.split([576, 192, 192], dim=-1)
    want_q, want_k = ops.apply_rotary(q.reshape(rows, 9, 64), k.reshape(rows, 3, 64), cos, sin)
    want_v = v.reshape(rows, 3, 64).clone()
    got_q, got_k, got_v = ops.rotate_qkv(qkv, cos, sin, 9, 3, 64)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_float32_native_ops_match_transformers_order():
    """float32 takes the native kernels too (engine/kernels/cpu/elementwise.c): the same operations in
    transformers' order, within a float32 rounding of it (the norm's summation order, SiLU's exp); the
    residual add is exact. Token parity with transformers is tested on them (test_parity_smollm2.py)."""
    if load_native() is None:
        pytest.skip("no C compiler: float32 stays on torch's operations")
    gen = torch.Generator().manual_seed(3)
    x, d, w = (
        torch.randn(70, 576, generator=gen),
        torch.randn(70, 576, generator=gen),
        torch.randn(576, generator=gen),
    )

    def transformers_order(y):
        return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5))

    assert torch.allclose(ops.rms_norm(x, w, 1e-5), transformers_order(x), rtol=1e-5, atol=1e-6)
    want_h = x + d
    h, normed = ops.add_rms_norm(x.clone(), d, w, 1e-5)
    assert torch.equal(h, want_h) and torch.allclose(
        normed, transformers_order(want_h), rtol=1e-5, atol=1e-6
    )
    gate_up = torch.randn(70, 2 * 1536, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(
        ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6
    )
    qkv = torch.randn(70, (9 + 2 * 3) * 64, generator=gen)
    angles = torch.rand(70, 32, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = qkv.clone().split([576, 192, 192], dim=-1)
    want_q, want_k = ops.apply_rotary(q.reshape(70, 9, 64), k.reshape(70, 3, 64), cos, sin)
    got_q, got_k, got_v = ops.rotate_qkv(qkv, cos, sin, 9, 3, 64)
    assert torch.allclose(got_q, want_q, rtol=1e-5, atol=1e-6) and torch.allclose(
        got_k, want_k, rtol=1e-5, atol=1e-6
    )
    assert torch.equal(got_v, v.reshape(70, 3, 64))


def _prompts() -> list[str]:
    """All parity prompts where the CPU computes bfloat16 natively. Elsewhere both sides emulate it, slowly:
    half of them, still 256 tokens for the 95% bound."""
    from engine.scheduler.device import cpu_has_native_bf16

    return list(PROMPTS) if cpu_has_native_bf16() else list(PROMPTS[:4])


@pytest.fixture(scope="module")
def bf16_outputs(engine, tokenizer):
    from engine import Engine

    eng = Engine(dtype="bfloat16", max_total_tokens=8192)
    try:
        ids = [tokenizer.encode(p) for p in _prompts()]
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        outs = eng.generate(input_ids=ids, sampling_params=params)
        alone = eng.generate(input_ids=ids[0], sampling_params=params)
        scored = eng.generate(
            input_ids=ids[:2],
            sampling_params={**params, "max_new_tokens": 16},
            return_logprob=True,
            top_logprobs_num=5,
        )
    finally:
        eng.shutdown()
    tops = [pos for o in scored for pos in o["meta_info"]["output_top_logprobs"]]
    return ids, [o["output_ids"] for o in outs], alone["output_ids"], tops


def assert_agrees_with_transformers_bf16(ids, outs, model_dir) -> None:
    """Teacher-forced: transformers in bfloat16 scores the engine's greedy continuations; its argmax is
    the engine's token at 95% of positions, and never more than 0.5 above it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    agree = total = 0
    for prompt, out in zip(ids, outs):
        assert len(out) == NEW_TOKENS
        seq = prompt + out
        with torch.inference_mode():
            logits = hf(torch.tensor([seq])).logits[0, len(prompt) - 1 : len(seq) - 1].float()
        chosen = torch.tensor(out)
        best = logits.max(-1).values
        margin = best - logits.gather(1, chosen[:, None]).squeeze(1)  # 0 where transformers agrees
        agree += int((margin == 0).sum())
        total += len(out)
        assert margin.max() <= 0.5, (
            f"a token transformers scores {float(margin.max())} below its best"
        )
    assert agree / total >= 0.95, (
        f"transformers' argmax is the engine's token at {agree}/{total} positions"
    )


def test_bf16_greedy_agrees_with_transformers_bf16(bf16_outputs, model_dir):
    ids, outs, *_ = bf16_outputs
    assert_agrees_with_transformers_bf16(ids, outs, model_dir)


def test_bf16_logits_are_not_rounded_to_bfloat16(bf16_outputs):
    """The final norm and lm_head run in float32: top logits do not sit on bfloat16's grid, where close
    candidates tie (0.125 apart near 16-32) and greedy picks by token id. Logprob gaps are logit gaps."""
    *_, tops = bf16_outputs
    assert len(tops) == 32
    on_grid = 0
    for position in tops:
        logprobs = [lp for lp, _, _ in position]
        gaps = torch.tensor([logprobs[0] - lp for lp in logprobs[1:]], dtype=torch.float64) * 2**10
        on_grid += bool(((gaps - gaps.round()).abs() < 2e-3).all())
    assert on_grid <= 4, (
        f"{on_grid} of 32 positions have every top-5 gap on a 2^-10 grid: bfloat16 logits"
    )


def test_bf16_batch_and_alone_agree(bf16_outputs):
    """The first prompt alone and in the batch of all of them: same prefix of greedy tokens for a while
    (batched kernels round differently, so not necessarily all 64)."""
    _, outs, alone, _ = bf16_outputs
    same = next((i for i, (a, b) in enumerate(zip(outs[0], alone)) if a != b), NEW_TOKENS)
    assert same >= 16, f"batched and alone greedy part after {same} tokens"


def test_native_bf16_silu_saturates_as_torch():
    """Gates beyond exp's float32 range: torch's exp(-x) overflows to inf (silu -> -0.0, and NaN at -inf);
    a clamp at 88 had given -6e-37 and inf instead."""
    if load_native() is None:
        pytest.fail("no C compiler: the native kernels could not be built on this machine")
    gate = torch.tensor(
        [-100.0, -88.5, -89.0, -1e30, float("-inf"), 100.0, 0.0, -3.0] * 8
    ).bfloat16()
    up = torch.full_like(gate, 2.0)
    gate_up = torch.cat([gate, up])[None]
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_and_mul(gate_up)[0]
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(got[keep], want[keep]) and torch.equal(
        got[keep].signbit(), want[keep].signbit()
    )


@pytest.mark.parametrize("kernel", [True, False], ids=["bf16_logits", "torch"])
# panels of 48, 32 and 16 columns
@pytest.mark.parametrize("rows,out", [(1, 96), (7, 160), (64, 96), (9, 208)])
def test_float32_head_against_float64(kernel, rows, out):
    """Float32Head: bfloat16 weights, float32 rows and logits, within float32 rounding of float64."""
    from engine.linear.f32_head import Float32Head

    lib = load_native() if kernel else None
    if kernel and (lib is None or lib.bf16_logits_support() != 1):
        pytest.skip("bf16_logits needs AVX-512F: the torch path is tested instead")
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(72, out, bias=False)
    linear.weight.data = (torch.randn(out, 72, generator=gen) * 0.1).bfloat16()
    x = torch.randn(rows, 72, generator=gen) * 3
    head = Float32Head(linear, lib)
    assert (head._lib is not None) == kernel
    got = head(x)
    want = x.double() @ linear.weight.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_auto_dtype_is_exact_on_the_cpu():
    """`auto` is float32 on every CPU, native bfloat16 or not (docs/quantization.md, "Which dtype"), and
    bfloat16 on CUDA."""
    from engine.scheduler.device import resolve_dtype

    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16

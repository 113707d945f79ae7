"""The fused decode path (engine/model/fused_decode.py, engine/kernels/cpu/elementwise.c): each float32 C op
against the torch op it replaces, and whole decode steps against the model's plain forward, in the quantized
modes (close; their layers in one C call, decode_layers.c, bitwise the Python loop's) and in the exact
mode on our linear kernels (bitwise: bfloat16, and float32 in one C call)."""

from __future__ import annotations


import pytest
import torch

from engine.ipc.messages import TokenizedRequest
from engine.sampling_params import SamplingParams
from engine.model.forward_batch import ForwardMode
from engine.kernels.cpu import load_native
from engine.kernels.ops import apply_rotary, rms_norm, silu_and_mul
from test_scheduler_steps import InProcess

needs_kernel = pytest.mark.skipif(
    load_native() is None, reason="no C compiler: the fused ops cannot be built"
)


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max() + 1e-6)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_elementwise_ops_match_torch(rows):
    lib, gen = load_native(), torch.Generator().manual_seed(rows)
    h, a, w = (torch.randn(rows, 576, generator=gen) for _ in range(3))
    out, want_h = torch.empty_like(h), h + a
    lib.add_rms_norm(
        h.data_ptr(), a.data_ptr(), w[0].data_ptr(), out.data_ptr(), rows, 576, 1e-5, 2
    )
    assert torch.equal(h, want_h) and close(out, rms_norm(want_h, w[0], 1e-5))
    # no residual
    lib.add_rms_norm(h.data_ptr(), None, w[0].data_ptr(), out.data_ptr(), rows, 576, 1e-5, 2)
    assert torch.equal(h, want_h) and close(out, rms_norm(want_h, w[0], 1e-5))

    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.rand(rows, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = qkv.clone().split([heads * d, kv_heads * d, kv_heads * d], -1)
    want_q, want_k = apply_rotary(q.reshape(rows, heads, d), k.reshape(rows, kv_heads, d), cos, sin)
    lib.rotary_qkv(
        qkv.data_ptr(), rows, qkv.stride(0), heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(), 2
    )
    got_q, got_k, got_v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    assert close(got_q.reshape(rows, heads, d), want_q) and close(
        got_k.reshape(rows, kv_heads, d), want_k
    )
    assert torch.equal(got_v, v)  # v is not rotated

    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4
    act = torch.empty(rows, 1536)
    lib.silu_mul(gate_up.data_ptr(), act.data_ptr(), rows, 1536, 2)
    assert close(act, silu_and_mul(gate_up))


def _both_ways(
    run: InProcess, max_new_tokens: int
) -> tuple[list, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Three requests and a short one to the end, every decode step computed by the plain forward, by the
    fused one's Python loop (decode_layers.py's one C call switched off for the step) and then by the
    installed fused one (which the step goes on with): (finished requests, [(plain, loop, fused) logits])."""
    model, seen = run.sched.runner.model, []
    fused = model.forward

    def loop(batch, backend):
        saved = model.__dict__.get("_decode_layers")
        # what _native caches where the C step cannot run
        model.__dict__["_decode_layers"] = (
            backend,
            None,
        )
        try:
            return fused(batch, backend)
        finally:
            if saved is None:
                del model.__dict__["_decode_layers"]
            else:
                model.__dict__["_decode_layers"] = saved

    def both(batch, backend):
        if batch.mode is ForwardMode.DECODE:
            plain = model.plain_forward(batch, backend)
            seen.append((plain, loop(batch, backend), fused(batch, backend)))
            return seen[-1][2]
        return fused(batch, backend)

    model.forward = both
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    run.submit(
        *(TokenizedRequest(f"r{i}", [1, 100 + i, 200 + 7 * i, 300], params) for i in range(3))
    )
    run.submit(
        TokenizedRequest(
            "short", [1, 5, 9], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        )
    )
    return run.finish_all(), seen


def _ran_in_one_call(model) -> None:
    """The float32 fused steps ran as decode_layers.c's one call, as the choice table chose
    (its decode-layers-c row off keeps the loop, which _both_ways runs beside it anyway)."""
    assert model.decode_choice.row == "decode-layers-c"
    assert model.__dict__["_decode_layers"][1] is not None


@needs_kernel
@pytest.mark.parametrize("mode,rel", [("int8", 1e-4), ("gguf", 1e-3), ("gguf-q8", 1e-3)])
def test_fused_decode_step_matches_the_plain_forward(model_dir, mode, rel):
    """Every decode step of three requests (one batch) computed both ways: logits within rel of their
    scale. The sums run in another order, a float32 rounding's worth; gguf then rounds each block of
    activations to int16 steps, which can move a value by a step (1.5e-5 of the block's largest) and
    30 layers carry it on, hence its looser bound (gguf-q8's int8 steps are coarser, but its linear
    layers compute each row alike on either path: what differs is the elementwise work's rounding,
    which moves fewer values by a step). The greedy tokens are the same."""
    run = InProcess(model_dir, max_total_tokens=2048, quantization=mode)
    try:
        model = run.sched.runner.model
        # the K/V store and attention as one C call
        assert run.sched.runner.backend.rows_decoder() is not None
        done, seen = _both_ways(run, 12)
        buffers, rows = model.__dict__["_fused_buffers"], model.__dict__["_fused_rows"]
        _ran_in_one_call(model)
        native = model.__dict__["_decode_layers"][1]
        # a kernel's failure names the layer and stage (it fails before any K/V store)
        if native is not None:
            native._layers[0].qkv.kind = 99
            h, cs = torch.zeros(1, model.cfg.hidden_size), torch.zeros(1, model.cfg.head_dim)
            with pytest.raises(RuntimeError, match="layer 0's qkv_proj failed with code -100"):
                native.run(h, cs, cs, run.sched.runner.backend.step_args(), 2)
    finally:
        run.close()
    assert len(done) == 4 and len(seen) >= 10
    assert len(rows) >= 2  # steps of several sizes, and one set of buffers under all of them
    for t, r in rows.items():
        assert all(
            r.ptr[name] == buf.data_ptr() and getattr(r, name).shape[0] == t
            for name, buf in buffers.items()
        )
    for plain, loop, got in seen:
        assert got.shape == plain.shape and close(got, plain, rel), float(
            (got - plain).abs().max() / plain.abs().max()
        )
        assert torch.equal(got.argmax(-1), plain.argmax(-1))
        assert torch.equal(got, loop)  # the one C call: the loop's kernels in its order on its rows


def test_exact_bf16_decode_steps_are_bitwise_the_plain_forwards(model_dir):
    """The exact mode in bfloat16, where its linear layers run on our kernel (AVX512_BF16, no AMX): decode steps
    go through fused_decode.py, and every step's logits are bitwise those of llama.py's forward (the same
    kernels in the same order), at batch 4 and 3; its greedy tokens then cannot differ from the plain path's.
    Elsewhere the plain forward stays."""
    from engine.linear import bf16

    run = InProcess(model_dir, dtype="bfloat16", max_total_tokens=2048)
    try:
        model = run.sched.runner.model
        installed = model.decode_path is not None  # llama.py's choose_decode_path sets it
        assert installed == (
            bf16.runs_here(load_native()) and run.sched.runner.dtype == torch.bfloat16
        )
        if not installed:
            pytest.skip(
                "no fused bfloat16 decode here (no AVX512_BF16, or AMX): checked it is not installed"
            )
        # the K/V store and attention as one bfloat16 call
        assert run.sched.runner.backend.rows_decoder() is not None
        done, seen = _both_ways(run, 10)
        assert model.__dict__["_fused_buffers"]["qkv"].dtype == torch.bfloat16
        # bfloat16 keeps the loop (decode_layers.py says why)
        assert model.__dict__["_decode_layers"][1] is None
    finally:
        run.close()
    assert len(done) == 4 and len(seen) >= 9
    assert {got.shape[0] for _, _, got in seen} >= {3, 4}
    for plain, loop, got in seen:
        assert (
            got.dtype == plain.dtype == torch.float32
            and torch.equal(got, plain)
            and torch.equal(got, loop)
        )


def test_exact_float32_decode_steps_are_bitwise_the_plain_forwards(model_dir):
    """The exact mode in float32, where its linear layers run on our kernel (F32Linear: AVX2 CPUs, where float32
    is packed): decode steps go through fused_decode.py as one C call (decode_layers.c), and every step's
    logits are bitwise those of llama.py's forward and of the Python loop, at batch 4 and 3; its greedy tokens
    then cannot differ from the plain path's, which the float32 parity tests hold to transformers'."""
    from engine.linear import f32_panels
    from engine.linear.onednn import packing_available

    run = InProcess(model_dir, dtype="float32", max_total_tokens=2048)
    try:
        model = run.sched.runner.model
        installed = model.decode_path is not None  # llama.py's choose_decode_path sets it
        here = f32_panels.runs_here(load_native()) and packing_available(torch.float32, "cpu")
        assert installed == here
        if not installed:
            pytest.skip(
                "no fused float32 decode here (float32 not packed on this CPU): checked it is not installed"
            )
        done, seen = _both_ways(run, 10)
        assert model.__dict__["_fused_buffers"]["qkv"].dtype == torch.float32
        _ran_in_one_call(model)
    finally:
        run.close()
    assert len(done) == 4 and len(seen) >= 9
    assert {got.shape[0] for _, _, got in seen} >= {3, 4}
    for plain, loop, got in seen:
        assert (
            got.dtype == plain.dtype == torch.float32
            and torch.equal(got, plain)
            and torch.equal(got, loop)
        )

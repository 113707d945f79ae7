"""Decode steps with their elementwise work in C and each linear layer's kernel called straight into reused
rows: the quantized modes (float32, engine/kernels/cpu/elementwise.c) and the exact mode where its linear
layers run on our own kernels (bfloat16: Bf16Linear, elementwise_bf16.c; float32: F32Linear, F32BlockLinear).
llama.py's choose_decode_path picks this path from the choice table (engine/linear/choose.py).

At batch 1 the norms, rotary, residual adds and SiLU of every layer are about a thousand torch calls a
step, each mostly dispatch; here each layer makes four C calls for them, and each residual add is fused
into the next norm. Only decode steps of up to MAX_ROWS rows take this path. In the quantized modes the
elementwise kernels are float32 ones the plain forward does not use (those modes promise no token
parity). In the exact mode they are the very kernels llama.py's operations call (engine/kernels/ops.py),
in the same order on the same rows: the logits are bitwise the plain forward's. In float32 the loop of
decode_forward can run as one C call a step (engine/model/decode_layers.py), the same kernels in the same
order; the loop stays for bfloat16 and where the table's decode-layers-c row is off.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.attention import AttentionBackend
from engine.model.decode_layers import DecodeLayers
from engine.model.decode_layers import build as build_decode_layers
from engine.model.forward_batch import ForwardBatch, ForwardMode

MAX_ROWS = 64


class FusedDecode:
    """A model's decode_path: decode steps of up to MAX_ROWS rows through decode_forward."""

    def __init__(self, lib, one_call: bool) -> None:
        self.lib = lib
        self.one_call = one_call  # float32: every layer in one C call where the backend allows

    def takes(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.input_ids.shape[0] <= MAX_ROWS

    @torch.inference_mode()
    def __call__(
        self, model: nn.Module, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        return decode_forward(model, batch, backend, self.lib, self.one_call)


class _Layer:
    """One decoder layer's direct kernel calls and norm weights, bound once (see QuantizedLinear.kernel_call)."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_id = attn.layer_id
        self.qkv, self.o = attn.qkv_proj.kernel_call, attn.o_proj.kernel_call
        self.gate_up, self.down = mlp.gate_up_proj.kernel_call, mlp.down_proj.kernel_call
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm


class _Rows:
    """The intermediate rows of a decode step of t rows: views of the first t rows of one set of
    MAX_ROWS-row buffers, reused every step (a step at batch 1 made about 200 fresh tensors). The first
    t rows of a row-major buffer are contiguous, so the kernels read and write them in place. Nothing
    here outlives a step's use: the logits are a fresh tensor, and the attention output (rows "attn", or a
    fresh tensor from backend.forward) is read by o_proj within the same layer."""

    def __init__(self, full: dict[str, torch.Tensor], cfg, t: int) -> None:
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, buf in full.items():
            setattr(self, name, buf[:t])
        q, k, v = self.qkv.split([q_size, kv_size, kv_size], dim=-1)
        self.q = q.view(t, cfg.num_heads, cfg.head_dim)
        self.k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        self.v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        self.ptr = {name: getattr(self, name).data_ptr() for name in (*full, "k", "v")}


def _plan(model: nn.Module) -> list[_Layer]:
    plan = model.__dict__.get("_fused_plan")
    if plan is None:
        plan = model.__dict__["_fused_plan"] = [_Layer(layer) for layer in model.layers]
    return plan


def _rows(model: nn.Module, t: int, dtype: torch.dtype) -> _Rows:
    """Views for t rows; the buffers themselves exist once, for MAX_ROWS (about 1.8 MB for SmolLM2-135M in
    float32), in the hidden state's dtype."""
    cache = model.__dict__.setdefault("_fused_rows", {})
    if t not in cache:
        full = model.__dict__.get("_fused_buffers")
        if full is None:
            cfg, inter = model.cfg, model.layers[0].mlp.down_proj.in_features
            qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            widths = {
                "normed": cfg.hidden_size,
                "qkv": qkv,
                "attn": cfg.num_heads * cfg.head_dim,
                "a": cfg.hidden_size,
                "gate_up": 2 * inter,
                "act": inter,
                "down": cfg.hidden_size,
            }
            full = model.__dict__["_fused_buffers"] = {
                name: torch.empty(MAX_ROWS, width, dtype=dtype) for name, width in widths.items()
            }
        cache[t] = _Rows(full, model.cfg, t)
    # one model, one dtype: buffers made for another would be misread
    if cache[t].qkv.dtype != dtype:
        raise TypeError(f"fused decode buffers are {cache[t].qkv.dtype}, the step's rows {dtype}")
    return cache[t]


def _native(
    model: nn.Module, backend: AttentionBackend, lib, one_call: bool
) -> DecodeLayers | None:
    """The one-call C step for this model and backend (decode_layers.py), described once; None where it
    cannot run, and the loop of decode_forward does the step."""
    cached = model.__dict__.get("_decode_layers")
    if cached is None or cached[0] is not backend:
        buffers = model.__dict__["_fused_buffers"]
        native = build_decode_layers(lib, model, backend, buffers) if one_call else None
        cached = model.__dict__["_decode_layers"] = (backend, native)
    return cached[1]


def _kernels(lib, dtype: torch.dtype) -> tuple:
    """(add_rms_norm, rotary_qkv, silu_mul) of the library for float32 or bfloat16 rows."""
    if dtype == torch.bfloat16:
        return lib.add_rms_norm_bf16, lib.rotary_qkv_bf16, lib.silu_mul_bf16
    if dtype == torch.float32:
        return lib.add_rms_norm, lib.rotary_qkv, lib.silu_mul
    raise TypeError(f"the fused decode step takes float32 or bfloat16 rows, not {dtype}")


def decode_forward(
    model: nn.Module,
    batch: ForwardBatch,
    backend: AttentionBackend,
    lib,
    one_call: bool = True,
) -> torch.Tensor:
    """What llama.py's LlamaForCausalLM.forward computes for a decode step, with the elementwise ops fused and the
    linear layers' kernels called straight into reused rows."""
    cfg = model.cfg
    backend.init_forward_metadata(batch)
    cos = model.rope_cos[batch.positions]  # gathers: fresh contiguous tensors
    sin = model.rope_sin[batch.positions]
    h = model.embed_tokens(batch.input_ids)
    t, hidden = h.shape
    rows = _rows(model, t, h.dtype)
    threads = torch.get_num_threads()
    native = _native(model, backend, lib, one_call)
    # every layer in one C call: the same kernels, order and rows as the loop below
    if native is not None:
        native.run(h, cos, sin, backend.step_args(), threads)  # float32 rows only
        return model.lm_head(rows.normed).float()
    add_rms_norm, rotary_qkv, silu_mul = _kernels(lib, h.dtype)
    p = rows.ptr
    h_ptr, cos_ptr, sin_ptr, qkv_stride = (
        h.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        rows.qkv.stride(0),
    )
    pending = None  # the last block's output, added to h by the next norm
    rows_decoder = getattr(backend, "rows_decoder", None)
    # K/V store and attention in one C call
    attend = rows_decoder() if rows_decoder is not None else None
    for layer in _plan(model):
        norm = layer.in_norm
        add_rms_norm(
            h_ptr, pending, norm.weight.data_ptr(), p["normed"], t, hidden, norm.eps, threads
        )
        layer.qkv()(p["normed"], p["qkv"], t)
        rotary_qkv(
            p["qkv"],
            t,
            qkv_stride,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cos_ptr,
            sin_ptr,
            threads,
        )
        if attend is not None:
            attend(layer.layer_id, p["qkv"], p["k"], p["v"], qkv_stride, p["attn"], t)
            layer.o()(p["attn"], p["a"], t)
        else:
            out = backend.forward(
                rows.q, rows.k, rows.v, layer.layer_id, batch
            ).contiguous()  # [t, heads, head_dim]
            layer.o()(out.data_ptr(), p["a"], t)
        norm = layer.post_norm
        add_rms_norm(
            h_ptr, p["a"], norm.weight.data_ptr(), p["normed"], t, hidden, norm.eps, threads
        )
        layer.gate_up()(p["normed"], p["gate_up"], t)
        silu_mul(p["gate_up"], p["act"], t, rows.act.shape[1], threads)
        layer.down()(p["act"], p["down"], t)
        pending = p["down"]
    # the plain forward's float32 norm and head, after the same residual add
    if h.dtype != torch.float32:
        return model.logits(h, rows.down)
    add_rms_norm(
        h_ptr,
        pending,
        model.norm.weight.data_ptr(),
        p["normed"],
        t,
        hidden,
        model.norm.eps,
        threads,
    )
    return model.lm_head(rows.normed).float()

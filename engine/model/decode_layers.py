"""A float32 decode step's decoder layers as one C call (engine/kernels/cpu/decode_layers.c), for
fused_decode.py: the quantized modes, and the exact mode on F32Linear or F32BlockLinear.

fused_decode.py's loop calls nine kernels a layer through ctypes, each a few microseconds of Python around
a kernel that at batch 1 runs for tens of them. The C loop calls the same kernels in the same order on
the same rows with the same threads, so the rows it leaves are bitwise those of the Python loop
(tests/test_fused_decode.py runs both; the choice table's decode-layers-c row turns it off). float32
rows only: bfloat16 decode keeps the loop, not yet measured and tested on a CPU with AVX512_BF16.

The layers are described once, at the first decode step: the weights' addresses (the linear layers'
buffers are made at load and never replaced by the engine), the norms' and the pool's K/V buffers'.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int32, c_int64, c_void_p

import torch


KINDS = {"int8": 1, "gguf": 2, "f32": 3, "f32blocks": 4}  # LINEAR_* in decode_layers.c
STAGES = ("qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj")


class DecodeLinear(ctypes.Structure):
    _fields_ = [
        ("kind", c_int32),
        ("arg", c_int32),
        ("threads", c_int32),
        ("pad", c_int32),
        ("n", c_int64),
        ("k", c_int64),
        ("w", c_void_p),
        ("scale", c_void_p),
        ("bias", c_void_p),
    ]


class DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("in_norm", c_void_p),
        ("post_norm", c_void_p),
        ("k_cache", c_void_p),
        ("v_cache", c_void_p),
        ("in_eps", c_float),
        ("post_eps", c_float),
        ("qkv", DecodeLinear),
        ("o", DecodeLinear),
        ("gate_up", DecodeLinear),
        ("down", DecodeLinear),
    ]


class DecodeModel(ctypes.Structure):
    _fields_ = [
        ("layers", c_int32),
        ("heads", c_int32),
        ("kv_heads", c_int32),
        ("head_dim", c_int32),
        ("attn_threads", c_int32),
        ("pad", c_int32),
        ("hidden", c_int64),
        ("inter", c_int64),
        ("attn_scale", c_float),
        ("final_eps", c_float),
        ("final_norm", c_void_p),
        ("normed", c_void_p),
        ("qkv", c_void_p),
        ("attn", c_void_p),
        ("a", c_void_p),
        ("gate_up", c_void_p),
        ("act", c_void_p),
        ("down", c_void_p),
    ]


def _linear(module) -> DecodeLinear | None:
    describe = getattr(module, "decode_linear", None)
    if describe is None:
        return None
    d = describe()
    return DecodeLinear(
        KINDS[d["kind"]],
        d.get("arg", 0),
        d["threads"],
        0,
        module.out_features,
        module.in_features,
        d["w"],
        d.get("scale"),
        d.get("bias"),
    )


class DecodeLayers:
    """The model's layers as decode_layers.c takes them; run() is one step."""

    def __init__(
        self,
        lib,
        model,
        attention: dict,
        buffers: dict[str, torch.Tensor],
        layers: list[DecodeLayer],
    ) -> None:
        cfg = model.cfg
        # kept alive
        self._lib, self._layers, self._buffers = (
            lib,
            (DecodeLayer * len(layers))(*layers),
            buffers,
        )
        rows = (
            buffers[n].data_ptr() for n in ("normed", "qkv", "attn", "a", "gate_up", "act", "down")
        )
        self._model = DecodeModel(
            len(layers),
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            attention["threads"],
            0,
            cfg.hidden_size,
            buffers["act"].shape[1],
            attention["scale"],
            model.norm.eps,
            model.norm.weight.data_ptr(),
            *rows,
        )
        self._err = (c_int32 * 3)()
        self._model_ptr, self._layers_ptr = (
            ctypes.addressof(self._model),
            ctypes.addressof(self._layers),
        )
        self._err_ptr = ctypes.addressof(self._err)

    def run(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step_args: tuple, threads: int
    ) -> None:
        """h [t, hidden] through every layer in place, the final norm's rows into the buffers' "normed"."""
        out_loc, table, stride, slots, lens = step_args
        rc = self._lib.decode_layers(
            self._model_ptr,
            self._layers_ptr,
            h.data_ptr(),
            h.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            out_loc,
            table,
            stride,
            slots,
            lens,
            threads,
            self._err_ptr,
        )
        if rc != 0:
            layer, stage, code = self._err
            raise RuntimeError(
                f"decode_layers: layer {layer}'s {STAGES[stage]} failed with code {code}"
            )


def build(lib, model, backend, buffers: dict[str, torch.Tensor]) -> DecodeLayers | None:
    """The C step for this model and attention backend, or None where it does not run (rows not float32,
    an attention backend without the one-call K/V store for them, a linear layer without decode_linear)."""
    if buffers["qkv"].dtype != torch.float32:
        return None
    args = getattr(backend, "layers_decoder_args", None)
    attention = args() if args is not None else None
    if attention is None:
        return None
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [
            _linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        if any(d is None for d in linears):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        layers.append(
            DecodeLayer(
                norms[0].weight.data_ptr(),
                norms[1].weight.data_ptr(),
                attention["k"][attn.layer_id],
                attention["v"][attn.layer_id],
                norms[0].eps,
                norms[1].eps,
                *linears,
            )
        )
    return DecodeLayers(lib, model, attention, buffers, layers)

"""int8 weights, one float32 scale per output channel; activations stay float32 (weight-only).

Chosen by measurement on SmolLM2-135M (AMD EPYC, AVX2, 2 threads; docs/quantization.md has the
figures). torch's fbgemm dynamic int8 linear was fast (batch 1: 6.0 ms per step of all linear layers
against float32's 18.4) but quantizes the activations too, per tensor, and this model's MLP
activations have outlier channels: perplexity went from 7.0 to 21.4. Weight-only int8 loses almost
nothing (8.88 against 8.90 on the same text). Its kernel is ours (engine/kernels/cpu/int8_linear.c): at
batch 1 5.3 ms per step, batch 8 20.2 against 50.0, batch 64 162 against 146. So up to
DIRECT_MAX_ROWS input rows go through it; more rows (prefill) multiply float32 weights dequantized for
the call, where the matmul's own work dwarfs the conversion (in tiles, engine/quantization/linear.py).
"""

from __future__ import annotations

import torch

from engine.quantization.linear import QuantizedLinear

DIRECT_MAX_ROWS = 64


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (int8 [N, K], float32 scale [N]) with weight ~= int8 * scale[:, None]."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(QuantizedLinear):
    """A frozen linear layer holding only int8 weights and their per-row scales."""

    kind_name, direct_max_rows = "int8", DIRECT_MAX_ROWS

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib, threads: int,
                 known: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
        """known: (int8 weight, scales) quantized before from this same weight (the on-disk cache)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        ok = (known is not None and known[0].dtype == torch.int8 and known[1].dtype == torch.float32
              and known[0].shape == weight.shape and known[1].shape == (self.out_features,)
              and known[0].is_contiguous() and known[1].is_contiguous())  # the kernel reads them raw  # fmt: skip
        if not ok and weight.is_meta:
            raise ValueError("int8 weights given for this layer do not fit it, and its float weight was not loaded")
        qweight, scale = known if ok else quantize_rows(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous())
        self._lib, self._threads = lib, threads

    def _dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        out.copy_(self.qweight[r0:r1]).mul_(self.scale[r0:r1, None])

    def _kernel_args(self):
        bias = None if self.bias is None else self.bias.data_ptr()
        return self._lib.int8_linear, (), (self.qweight.data_ptr(), self.scale.data_ptr(), bias)

    def decode_linear(self) -> dict:
        """The layer as engine/model/decode_layers.py hands it to the C step (the addresses _kernel_args passes)."""
        bias = None if self.bias is None else self.bias.data_ptr()
        return {"kind": "int8", "threads": self._threads, "w": self.qweight.data_ptr(), "scale": self.scale.data_ptr(),
                "bias": bias}  # fmt: skip

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights, per-row scales"

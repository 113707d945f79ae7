"""Llama-family decoder (Llama, SmolLM, Qwen2, Mistral without sliding window) over the token KV pool.

Fused projections (qkv, gate_up) cut the matmul count per layer from seven to four. The final norm and
lm_head run only on the rows that need logits (one per request), not on every prompt token.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.kernels.attention import AttentionBackend
from engine.model.forward_batch import ForwardBatch, ForwardMode
from engine.kernels.ops import add_rms_norm, rms_norm, rotate_qkv, silu_and_mul
from engine.linear.choose import Choice, Where, choose_decode_path
from engine.linear.torch import Linear
from engine.model.fused_decode import FusedDecode


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, backend: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = rotate_qkv(
            self.qkv_proj(x), cos, sin, self.num_heads, self.num_kv_heads, self.head_dim
        )
        out = backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, delta, cos, sin, backend, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """h + delta is this layer's input: the previous layer's MLP output (delta) is added here, fused with
        the norm after it, as is the attention output; returns (h, this layer's MLP output). The
        batch's taps see the attention and MLP outputs (engine/taps)."""
        taps, i = batch.taps, self.self_attn.layer_id
        norm = self.input_layernorm
        h, x = add_rms_norm(h, delta, norm.weight, norm.eps)
        attn = self.self_attn(x, cos, sin, backend, batch)
        if taps is not None:
            attn = taps.at(i, "attn_out", attn)
        norm = self.post_attention_layernorm
        h, x = add_rms_norm(h, attn, norm.weight, norm.eps)
        mlp = self.mlp(x)
        return h, mlp if taps is None else taps.at(i, "mlp_out", mlp)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        head_rows: int | None = None,
    ) -> None:
        """head_rows: the lm_head's vocabulary rows where a tensor-parallel rank holds a part of them."""
        super().__init__()
        self.cfg = cfg
        # _weight skips the random init: every weight is loaded, so the init would only cost start-up
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, head_rows or cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.requires_grad_(False)
        self.linear_choices: dict[str, Choice] = {}  # the choice table's pick for each linear layer
        self.decode_choice = Choice("plain", "plain", "llama.py's forward, op by op")
        self.decode_path: FusedDecode | None = None  # set by choose_decode_path

    def choose_decode_path(self, where: Where, lib) -> None:
        """Decode steps go through fused_decode.FusedDecode (each layer's kernel called directly, the
        elementwise ops fused; for float32, all layers in one C call) where the table puts every decoder
        layer on a kernel with a direct call: the same logits as plain_forward, less Python a step."""
        impls = {c.impl for n, c in self.linear_choices.items() if n.startswith("layers.")}
        self.decode_choice = choose_decode_path(where, impls)
        fused = self.decode_choice.impl in ("fused", "fused-c")
        self.decode_path = FusedDecode(lib, self.decode_choice.impl == "fused-c") if fused else None

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Logits [B, vocab] in float32 for each request's last new token: small decode steps on the fused
        decode path where choose_decode_path chose it (and nothing taps a layer), everything else on
        plain_forward."""
        fused = self.decode_path
        if fused is not None and batch.taps is None and fused.takes(batch):
            return fused(self, batch, backend)
        return self.plain_forward(batch, backend)

    @torch.inference_mode()
    def plain_forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """The forward pass op by op, every layer through its modules."""
        backend.init_forward_metadata(batch)
        cos = self.rope_cos[batch.positions]
        sin = self.rope_sin[batch.positions]
        h, delta = self.embed_tokens(batch.input_ids), None
        taps = batch.taps
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, backend, batch)
            if taps is not None and i in taps.resid_layers:  # the residual stream, made whole
                h, delta = taps.at(i, "resid_post", h + delta), None
        if batch.mode is ForwardMode.EXTEND:
            h = h[batch.logits_indices]
            delta = None if delta is None else delta[batch.logits_indices]
        return self.logits(h, delta)

    def logits(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """float32 logits of the rows h + delta. In bfloat16 the residual add rounds as the layers' do, then
        the final norm and lm_head (a Float32Head) run in float32: nothing rounds the logits to bfloat16."""
        if h.dtype == torch.float32:
            return self.lm_head(add_rms_norm(h, delta, self.norm.weight, self.norm.eps)[1]).float()
        if delta is not None:
            h = h + delta
        return self.lm_head(rms_norm(h.float(), self.norm.weight.float(), self.norm.eps))


def weight_plan(cfg: ModelConfig, names: set[str]) -> dict[str, list[str]]:
    """Hugging Face names -> ours: each of our weights is its checkpoint tensors stacked along dim 0, in
    order (q/k/v into qkv_proj, gate/up into gate_up_proj; one name for the rest). The loader reads
    each part straight into its rows of the fused tensor."""
    plan: dict[str, list[str]] = {
        "embed_tokens.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, q, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        plan[f"layers.{i}.self_attn.qkv_proj.weight"] = [
            q + "q_proj.weight",
            q + "k_proj.weight",
            q + "v_proj.weight",
        ]
        if cfg.qkv_bias:
            plan[f"layers.{i}.self_attn.qkv_proj.bias"] = [
                q + "q_proj.bias",
                q + "k_proj.bias",
                q + "v_proj.bias",
            ]
        plan[f"layers.{i}.self_attn.o_proj.weight"] = [q + "o_proj.weight"]
        if cfg.o_bias:
            plan[f"layers.{i}.self_attn.o_proj.bias"] = [q + "o_proj.bias"]
        plan[f"layers.{i}.mlp.gate_up_proj.weight"] = [m + "gate_proj.weight", m + "up_proj.weight"]
        plan[f"layers.{i}.mlp.down_proj.weight"] = [m + "down_proj.weight"]
        if cfg.mlp_bias:
            plan[f"layers.{i}.mlp.gate_up_proj.bias"] = [m + "gate_proj.bias", m + "up_proj.bias"]
            plan[f"layers.{i}.mlp.down_proj.bias"] = [m + "down_proj.bias"]
        plan[f"layers.{i}.input_layernorm.weight"] = [p + "input_layernorm.weight"]
        plan[f"layers.{i}.post_attention_layernorm.weight"] = [
            p + "post_attention_layernorm.weight"
        ]
    used = {n for parts in plan.values() for n in parts}
    missing = sorted(used - names)
    # older exports' buffers, which transformers drops too
    unexpected = sorted(
        n
        for n in names - used - {"lm_head.weight"}  # tied copies some exporters write anyway
        if not n.endswith("rotary_emb.inv_freq")
    )
    if missing:
        raise ValueError(f"weights missing from checkpoint: {missing[:8]}")
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {unexpected[:8]}")
    return plan

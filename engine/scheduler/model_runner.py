"""The model runner: loads the model, sizes and holds its KV pools and attention backend, and runs
a step's forward pass. The scheduler decides what runs; this runs it. Under tensor parallelism it
holds this rank's shard: its KV heads' pool, of the size every rank agrees on."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.distributed.errors import RankLost
from engine.kernels.attention import create_backend
from engine.linear.choose import native_extend
from engine.linear.parallel import Collectives
from engine.memory import ReqToTokenPool, TokenKVPool
from engine.model.config import load_hf_config
from engine.model.forward_batch import ForwardBatch
from engine.model.loader import load_model
from engine.quantization import check_quantization, resolve_device_for, resolve_dtype_for
from engine.scheduler.device import pool_size, resolve_device, resolve_dtype


class ModelRunner:
    """The model, its config, the KV pool and request-to-token table it writes, the attention backend."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        progress=None,
        group: Collectives | None = None,
    ) -> None:
        self.device = resolve_device(resolve_device_for(config.quantization, config.device))
        self.dtype = resolve_dtype(
            resolve_dtype_for(config.quantization, config.dtype), self.device
        )
        check_quantization(config.quantization, self.device, self.dtype)
        config.check_parallel_device(str(self.device))
        hf_config = load_hf_config(model_dir)
        max_pos = hf_config.max_position_embeddings
        if config.context_length is not None and config.context_length > max_pos:
            raise ValueError(  # refused rather than cut down unseen
                f"context_length={config.context_length} is more than the model's "
                f"max_position_embeddings ({max_pos})"
            )
        self.context_len = config.context_length or max_pos
        self.model, self.model_config = load_model(
            model_dir,
            hf_config,
            self.dtype,
            self.device,
            self.context_len,
            progress,
            config.quantization,
            config.kernel_overrides,
            group,
            config.reduce_like_tp,
        )
        self.group = group
        mc = self.model.cfg  # this rank's heads under tensor parallelism, else the model's
        self.bytes_per_token = TokenKVPool.bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype
        )
        cap = config.max_running_requests * self.context_len
        self.max_total_tokens = pool_size(
            config.max_total_tokens, config.mem_fraction, self.bytes_per_token, self.device, cap
        )
        if group is not None:  # the same pool everywhere, or the ranks would schedule apart
            self.max_total_tokens = group.agree_min(self.max_total_tokens)
        self.req_to_token = ReqToTokenPool(
            config.max_running_requests, self.context_len, self.device
        )
        self.kv_pool = TokenKVPool(
            self.max_total_tokens,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
        )
        self.backend = create_backend(
            config.attention_backend,
            self.device,
            native_extend(config.kernel_overrides),
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            scale=mc.head_dim**-0.5,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token.table,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of the batch's logits rows. Under tensor parallelism a failing forward ends
        the rank: its peers may be waiting in a collective it will never join."""
        if self.group is None:
            return self.model(batch, self.backend)
        try:
            return self.model(batch, self.backend)
        except Exception as exc:
            raise RankLost(f"the forward failed: {type(exc).__name__}: {exc}") from exc

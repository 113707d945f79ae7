"""Which part of the model a load builds: the whole model, or one tensor-parallel rank's shard.

The loader asks its layout for the meta model, the layer shapes, the weight plan, how to cut stored
blocks and read floats, and how to finish the model; only the layout knows whether there is a shard.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.distributed.shard import Shard, shard_blocks, shard_floats, shard_int8
from engine.linear.build import NO_FLOATS
from engine.linear.choose import Choice
from engine.linear import f32_blocks
from engine.linear.f32_blocks import Blocks
from engine.linear.gguf import BLOCK_BYTES
from engine.linear.parallel import Collectives, wrap_model
from engine.linear.shard_sums import sum_like_ranks
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM, weight_plan
from engine.quantization import linear_shapes

Reference = Callable[[str], torch.Tensor]


class WholeModel:
    """The whole model in one process. shapes: this load's layer shapes; whole_shapes: the whole
    model's (the stored weights' and the files' shapes); tied: the lm_head is the embedding;
    reduce_like: sum the row-parallel layers as that many ranks do (engine/linear/shard_sums.py)."""

    tp = False

    def __init__(self, cfg: ModelConfig, reduce_like: int = 0) -> None:
        self.cfg, self.reduce_like = cfg, reduce_like
        # computed as ranks compute: the table's rows for shards (no whole-weight rows, plain decode)
        self.like_tp = reduce_like > 1
        if (
            self.like_tp and not self.tp
        ):  # one scheduler summing like ranks: refused before the load
            Shard.plan(cfg, 0, reduce_like)  # no more ranks than KV heads
            if cfg.o_bias or cfg.mlp_bias:
                raise ValueError(
                    "reduce_like_tp: a model whose o_proj or down_proj has a bias is not built"
                )
        self.tied = cfg.tie_word_embeddings
        self.shapes: dict[str, tuple[int, int]] = {}
        self.whole_shapes: dict[str, tuple[int, int]] = {}

    def meta_model(self, cos: torch.Tensor, sin: torch.Tensor) -> LlamaForCausalLM:
        """The model to load into, on the meta device; sets shapes and whole_shapes."""
        with torch.device("meta"):
            model = LlamaForCausalLM(self.cfg, cos.to("meta"), sin.to("meta"))
        self.shapes = self.whole_shapes = linear_shapes(model)
        return model

    def weight_plan(self, names: set[str]) -> dict[str, list[str]]:
        """Each weight the model holds -> the file tensors it is read from."""
        return weight_plan(self.cfg, names)

    def cut_stored(self, stored: dict | None, mode: str) -> dict | None:
        """The stored quantized weights this load keeps (GGUF blocks; int8 weights and scales)."""
        return stored

    def exact_blocks(self, model_dir: str, reference: Reference, lib) -> Blocks | None:
        """The GGUF blocks the float32 weights are exactly (f32_blocks.py), or None."""
        return f32_blocks.exact_blocks(model_dir, self.cfg, self.shapes, reference, lib)

    def read_plan(
        self, now: dict, later: dict, choices: dict[str, Choice]
    ) -> tuple[dict, dict, set[str]]:
        """(weights to read now, those packed later from views of the file, those never read)."""
        return now, later, set()

    def cut_floats(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The read float weights this load keeps."""
        return state

    def finish(self, model: LlamaForCausalLM) -> None:
        """The loaded model made ready to run."""
        if self.like_tp:
            sum_like_ranks(model, self.cfg, self.reduce_like)


class RankShard(WholeModel):
    """One tensor-parallel rank's shard: its heads and rows, its lm_head a slice of the vocabulary
    (never the embedding itself)."""

    tp = True

    def __init__(self, cfg: ModelConfig, group: Collectives, reduce_like: int = 0) -> None:
        super().__init__(cfg, reduce_like)
        self.like_tp = True
        self.shard = Shard.plan(cfg, group.rank, group.size)
        self.group = group
        self.tied = False

    def meta_model(self, cos: torch.Tensor, sin: torch.Tensor) -> LlamaForCausalLM:
        with torch.device("meta"):
            whole = LlamaForCausalLM(self.cfg, cos.to("meta"), sin.to("meta"))
            model = LlamaForCausalLM(
                self.shard.local_config(self.cfg),
                cos.to("meta"),
                sin.to("meta"),
                len(self.shard.vocab),
            )
        self.shapes, self.whole_shapes = linear_shapes(model), linear_shapes(whole)
        return model

    def weight_plan(self, names: set[str]) -> dict[str, list[str]]:
        plan = weight_plan(self.cfg, names)
        if self.cfg.tie_word_embeddings:  # the rank's lm_head: its slice of the embedding
            plan["lm_head.weight"] = plan["embed_tokens.weight"]
        return plan

    def cut_stored(self, stored: dict | None, mode: str) -> dict | None:
        if stored is None:
            return None
        if mode == "int8":
            return shard_int8(stored, self.shard, self.cfg)
        return shard_blocks(stored, self.shard, self.cfg, BLOCK_BYTES)

    def exact_blocks(self, model_dir: str, reference: Reference, lib) -> Blocks | None:
        """The shard of the exact blocks, checked against the shard of the float weights."""
        blocks = f32_blocks.file_blocks(model_dir, self.cfg, self.whole_shapes, reference, lib)
        if blocks is None:
            return None
        blocks = shard_blocks(blocks, self.shard, self.cfg, BLOCK_BYTES, strict=False)

        def local(name: str) -> torch.Tensor:  # the rank's shard of a converted weight
            key = f"{name}.weight"
            return shard_floats({key: reference(name)}, self.shard, self.cfg)[key]

        return f32_blocks.checked_blocks(blocks, self.shapes, local, lib)

    def read_plan(
        self, now: dict, later: dict, choices: dict[str, Choice]
    ) -> tuple[dict, dict, set[str]]:
        """Read whole, then cut: no layer packs from a view of the file."""
        unread = {k for k in later if choices[k.removesuffix(".weight")].impl in NO_FLOATS}
        now = {**now, **{k: v for k, v in later.items() if k not in unread}}
        return now, {}, unread

    def cut_floats(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_floats(state, self.shard, self.cfg)

    def finish(self, model: LlamaForCausalLM) -> None:
        """Row-parallel layers summed and the lm_head's logits gathered across the ranks."""
        ordered = self.reduce_like == self.group.size
        wrap_model(model, self.shard.vocab_widths, self.group, ordered)


def model_layout(cfg: ModelConfig, group: Collectives | None, reduce_like: int = 0) -> WholeModel:
    """The whole model without a tensor-parallel group, else this rank's shard."""
    if group is None:
        return WholeModel(cfg, reduce_like)
    return RankShard(cfg, group, reduce_like)

"""Which part of each weight a tensor-parallel rank holds, for float weights and GGUF blocks alike.

Column parallel (split by output rows, nothing to add up): qkv_proj by KV-head groups, each KV head
with its query heads; gate_up_proj by intermediate rows; lm_head by vocabulary rows (the logits are
gathered). Row parallel (split by input columns, the ranks' outputs summed): o_proj by the same
query heads, down_proj by the same intermediate rows. KV heads go to ranks as evenly as they divide
(9 query heads over 3 KV heads on 2 ranks: 6 + 3), so attention needs no replicated heads; columns
are cut on GGUF block boundaries (32 weights), so a block format shards as its floats do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.model.config import ModelConfig

BLOCK = 32  # weights per GGUF block: row-parallel columns are cut only between blocks
# down_proj's columns are cut between pairs of blocks where they divide so: the gguf kernel takes
# blocks two at a time, so a part of whole pairs sums as the whole layer's columns do (reduce_like_tp)
INTER_UNITS = (2 * BLOCK, BLOCK)


def _split(total: int, size: int, rank: int, units: tuple[int, ...] = (1,)) -> range:
    """rank's part of range(total) cut into `size` parts as even as the first of `units` dividing total
    allows (else 1), larger parts first."""
    unit = next((u for u in units if total % u == 0), 1)
    base, extra = divmod(total // unit, size)
    start = rank * base + min(rank, extra)
    return range(start * unit, (start + base + (rank < extra)) * unit)


@dataclass(frozen=True)
class Shard:
    """One rank's part of the model: its KV heads (and their query heads), its intermediate rows, its
    vocabulary rows; widths: every rank's vocabulary rows, for the gather."""

    rank: int
    size: int
    kv_heads: range
    heads: range
    inter: range
    vocab: range
    vocab_widths: tuple[int, ...]

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        if cfg.num_kv_heads < size:
            raise ValueError(
                f"{size} ranks (tp_size or reduce_like_tp) are more than the model's "
                f"{cfg.num_kv_heads} KV heads (replicated KV heads are not built)"
            )
        group = cfg.num_heads // cfg.num_kv_heads
        kv = _split(cfg.num_kv_heads, size, rank)
        vocab = [_split(cfg.vocab_size, size, r, (BLOCK,)) for r in range(size)]
        return cls(
            rank=rank,
            size=size,
            kv_heads=kv,
            heads=range(kv.start * group, kv.stop * group),
            inter=_split(cfg.intermediate_size, size, rank, INTER_UNITS),
            vocab=vocab[rank],
            vocab_widths=tuple(len(v) for v in vocab),
        )

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank's layers are built from: its heads and intermediate rows; its lm_head
        never the embedding (it is a slice of it)."""
        return replace(
            cfg,
            num_heads=len(self.heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.inter),
            tie_word_embeddings=False,
        )

    def rows(self, layer: str, cfg: ModelConfig) -> list[range] | None:
        """The output rows this rank keeps of a column-parallel layer, or None."""
        d = cfg.head_dim
        if layer.endswith("qkv_proj"):
            q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
            k0, k1 = self.kv_heads.start * d, self.kv_heads.stop * d
            return [
                range(self.heads.start * d, self.heads.stop * d),
                range(q + k0, q + k1),
                range(q + kv + k0, q + kv + k1),
            ]
        if layer.endswith("gate_up_proj"):
            n = cfg.intermediate_size
            return [self.inter, range(n + self.inter.start, n + self.inter.stop)]
        if layer == "lm_head":
            return [self.vocab]
        return None

    def columns(self, layer: str, cfg: ModelConfig) -> range | None:
        """The input columns this rank keeps of a row-parallel layer, or None."""
        if layer.endswith("o_proj"):
            return range(self.heads.start * cfg.head_dim, self.heads.stop * cfg.head_dim)
        if layer.endswith("down_proj"):
            return self.inter
        return None

    def first(self) -> bool:
        return self.rank == 0


def column_cuts(layer: str, cfg: ModelConfig, size: int) -> list[range] | None:
    """Every rank's input columns of a row-parallel layer under `size` ranks, in rank order; None for
    another layer."""
    cuts = [Shard.plan(cfg, rank, size).columns(layer, cfg) for rank in range(size)]
    return None if cuts[0] is None else cuts


def _take_rows(t: torch.Tensor, rows: list[range]) -> torch.Tensor:
    return torch.cat([t[r.start : r.stop] for r in rows]).contiguous()


def shard_floats(
    state: dict[str, torch.Tensor], shard: Shard, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """This rank's part of each read weight (name.weight / name.bias); a row-parallel bias is added
    once, by rank 0 (the others hold zeros)."""
    out = {}
    for key, t in state.items():
        layer, _, kind = key.rpartition(".")
        rows, cols = shard.rows(layer, cfg), shard.columns(layer, cfg)
        if rows is not None:
            t = _take_rows(t, rows)
        elif cols is not None and kind == "weight":
            t = t[:, cols.start : cols.stop].contiguous()
        elif cols is not None and kind == "bias" and not shard.first():
            t = torch.zeros_like(t)
        out[key] = t
    return out


def shard_blocks(
    blocks: dict[str, tuple[int, torch.Tensor]],
    shard: Shard,
    cfg: ModelConfig,
    block_bytes: dict,
    strict: bool = True,
) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's part of each layer's GGUF blocks [out, row bytes]: rows as the floats', columns
    in whole blocks. A layer whose columns would cut blocks apart: a ValueError, or (not strict:
    the exact mode, which has the floats) left out."""
    out = {}
    for layer, (kind, b) in blocks.items():
        rows, cols = shard.rows(layer, cfg), shard.columns(layer, cfg)
        if rows is not None:
            b = _take_rows(b, rows)
        elif cols is not None:
            if (cols.start % BLOCK or cols.stop % BLOCK) and not strict:
                continue
            if cols.start % BLOCK or cols.stop % BLOCK:
                raise ValueError(
                    f"{layer}: columns {cols.start}..{cols.stop} do not fall on GGUF block "
                    f"boundaries ({BLOCK}); tp_size={shard.size} cannot shard this model's blocks"
                )
            per = block_bytes[kind]
            b = b[:, cols.start // BLOCK * per : cols.stop // BLOCK * per].contiguous()
        out[layer] = (kind, b)
    return out


def shard_int8(
    stored: dict[str, torch.Tensor], shard: Shard, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """This rank's part of the whole model's int8 weights (name.qweight, name.scale: the cache's,
    engine/linear/int8.py). Rows as the floats'; a row-parallel layer's columns cut from rows
    quantized whole, so each keeps its whole row's scale, as one scheduler's do."""
    from engine.linear.int8 import as_stored, rows_of

    out = {}
    for key, t in stored.items():
        layer, _, kind = key.rpartition(".")
        rows, cols = shard.rows(layer, cfg), shard.columns(layer, cfg)
        if kind == "scale":
            out[key] = _take_rows(t, rows) if rows is not None else t
            continue
        n = stored[f"{layer}.scale"].shape[0]
        q = rows_of(t, n, t.numel() // n)
        if rows is not None:
            q = _take_rows(q, rows)
        elif cols is not None:
            q = q[:, cols.start : cols.stop].contiguous()
        out[key] = as_stored(q)
    return out

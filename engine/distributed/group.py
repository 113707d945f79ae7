"""The tensor-parallel ranks' torch.distributed group (gloo on the CPU) and the few collectives the
engine uses: sums after row-parallel layers, the vocabulary shards' logits gathered, bytes shared.

A collective that fails means a rank is gone: RankLost, a BaseException, goes past the scheduler's
per-step guards and ends the process (the user process then stops the engine with a clear error).
"""

from __future__ import annotations

import datetime
import logging
import os
import random

import torch
import torch.distributed as dist

from engine.distributed.errors import RankLost

logger = logging.getLogger(__name__)

# how long a rank waits in one collective; rank 0 shares an empty turn more often than this when idle
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class TPGroup:
    """This rank's place among `size` ranks, and the collectives over them."""

    def __init__(self, rank: int, size: int, addr: str) -> None:
        self.rank, self.size = rank, size
        host = addr.rpartition(":")[0]
        if host in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would pick the hostname's interface
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{addr}",
            rank=rank,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        logger.info(
            "engine::scheduler: tensor-parallel rank %d of %d joined at %s", rank, size, addr
        )

    def _run(self, what: str, op, *args) -> None:
        try:
            op(*args)
        except RuntimeError as exc:
            raise RankLost(f"tensor-parallel rank {self.rank}: {what} failed: {exc}") from exc

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks (in place where t is contiguous); every rank gets the same bits."""
        t = t.contiguous()
        self._run("all_reduce", dist.all_reduce, t)
        return t

    def ordered_sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks in rank order, ((t0 + t1) + t2) ..., on every rank: the order a
        whole model summing like these ranks takes (engine/linear/shard_sums.py). Two ranks' sum is
        the all-reduce's (a + b is b + a); more gather every rank's t."""
        if self.size <= 2:
            return self.all_reduce_(t)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all_gather", dist.all_gather, parts, t)
        total = parts[0]
        for part in parts[1:]:
            total.add_(part)
        return total

    def gather_columns(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """[rows, widths[rank]] from each rank -> [rows, sum(widths)], rank by rank (gloo gathers equal
        shapes: narrower shards are padded and cut)."""
        wide = max(widths)
        if t.shape[-1] < wide:
            t = torch.nn.functional.pad(t, (0, wide - t.shape[-1]))
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all_gather", dist.all_gather, parts, t.contiguous())
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t on every rank, in place."""
        self._run("broadcast", dist.broadcast, t, 0)
        return t

    def share_bytes(self, messages: list[bytes] | None) -> list[bytes]:
        """Rank 0's messages (raw bytes, never pickled) on every rank: their count and lengths first,
        then their bytes in one buffer. Others pass None."""
        head = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            head[0] = len(messages)
        count = int(self.broadcast_(head)[0])
        if count == 0:
            return []
        lengths = torch.zeros(count, dtype=torch.int64)
        if self.rank == 0:
            lengths = torch.tensor([len(m) for m in messages], dtype=torch.int64)
        self.broadcast_(lengths)
        total = int(lengths.sum())
        if total == 0:
            return [b""] * count
        buf = torch.empty(total, dtype=torch.uint8)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(b"".join(messages)), dtype=torch.uint8)
        self.broadcast_(buf)
        if self.rank == 0:
            return messages
        data, out, at = buf.numpy().tobytes(), [], 0
        for n in lengths.tolist():
            out.append(data[at : at + n])
            at += n
        return out

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values, on every rank (the KV pool's size: the same everywhere)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._run("all_reduce", dist.all_reduce, t, dist.ReduceOp.MIN)
        return int(t[0])

    def shared_seed(self) -> int:
        """One random seed, rank 0's, on every rank: unseeded sampling draws the same on all of them."""
        t = torch.tensor([random.getrandbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        return int(self.broadcast_(t)[0])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

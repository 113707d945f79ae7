"""Weights that are transformed at load (packed into oneDNN's or our kernel's layout, converted to another
dtype) taken from views of their file's mapping, instead of being read into memory first.

Why: a plain read copies every byte into freshly allocated memory, and the transform then writes a
second fresh copy; the kernel zeroes each new page on first touch. On an AMD EPYC Zen 1 reading the
540 MB float32 SmolLM2-135M took 0.46-0.54 s, mapping it 0.04 s; packing from the mapping skips the
read. A weight of several parts (fused qkv, gate_up) or of another dtype is stacked into one scratch
buffer, reused for the next weight, so its pages are touched once. The pages of a weight already
transformed are given back before the next one is mapped in: the scheduler never holds the file beside
the packed copies.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch


class WeightViews:
    """Private read-only-in-practice mappings of safetensors files (copy-on-write: nothing can reach the
    file), and one weight at a time out of them."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._scratch: torch.Tensor | None = None
        self._last: list = []  # the entries of the weight handed out last: their pages go back on the next call

    def view(self, entry) -> torch.Tensor:
        """The entry's tensor (a loader.TensorEntry: path, offset, nbytes, dtype, shape) as it lies in its
        file; the bounds were checked against the file when the header was read."""
        m = self._maps.get(entry.path)
        if m is None:
            with open(entry.path, "rb") as f:
                m = self._maps[entry.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        count = entry.nbytes // torch.empty((), dtype=entry.dtype).element_size()
        return torch.frombuffer(m, dtype=entry.dtype, count=count, offset=entry.offset).view(entry.shape)

    def stacked(self, entries: list, dtype: torch.dtype) -> torch.Tensor:
        """The entries stacked along dim 0 in `dtype`: a view of the file where that is one entry of that
        dtype, else the scratch buffer, which the next call overwrites. Use it (pack or copy it) first."""
        self.release()
        self._last = list(entries)
        views = [self.view(e) for e in entries]
        if len(views) == 1 and views[0].dtype == dtype:
            return views[0]
        shape = [sum(v.shape[0] if v.dim() else 1 for v in views), *views[0].shape[1:]]
        n = math.prod(shape)
        if self._scratch is None or self._scratch.dtype != dtype or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=dtype)
        out, start = self._scratch[:n].view(shape), 0
        for v in views:
            rows = v.shape[0] if v.dim() else 1
            out[start : start + rows].copy_(v.reshape(rows, *shape[1:]))
            start += rows
        return out

    def release(self) -> None:
        """Give back the mapped pages of the weight handed out last (whole pages inside its bytes)."""
        for e in self._last:
            m, page = self._maps.get(e.path), mmap.PAGESIZE
            start, end = -(-e.offset // page) * page, (e.offset + e.nbytes) // page * page
            if m is not None and end > start and hasattr(mmap, "MADV_DONTNEED"):
                m.madvise(mmap.MADV_DONTNEED, start, end - start)
        self._last = []

    def close(self) -> None:
        """Pages back, scratch freed; each mapping goes when the last view of it does."""
        self.release()
        self._maps.clear()
        self._scratch = None

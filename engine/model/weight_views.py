"""Weights that are transformed at load (packed into oneDNN's or our kernel's layout) taken from mappings
of their file (mapped_weight.py), instead of being read into memory first.

Why: a plain read copies every byte into freshly allocated memory, and the transform then writes a
second fresh copy; the kernel zeroes each new page on first touch. Mapping costs a fraction of
reading (docs/performance.md); packing from the mapping skips the read. A weight of several parts
(fused qkv, gate_up) or of another dtype is stacked into one scratch buffer, reused for the next
weight, so its pages are touched once. The pages of a weight already
transformed are given back before the next one is mapped in: the scheduler never holds the file beside
the packed copies.
"""

from __future__ import annotations

import math
import mmap

import torch

from engine.model.mapped_weight import MappedWeight


class WeightViews:
    """One weight at a time out of its file's mappings, copy-on-write (nothing can reach the file)."""

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None
        self._last: list[
            MappedWeight
        ] = []  # the weight handed out last: its pages go back on the next call

    def stacked(self, entries: list, dtype: torch.dtype) -> torch.Tensor:
        """The entries (safetensors_io.TensorEntry: path, offset, nbytes, dtype, shape) stacked along dim 0 in
        `dtype`: a view of the file where that is one entry of that dtype, else the scratch buffer, which
        the next call overwrites. Use it (pack or copy it) first."""
        self.release()
        self._last = [MappedWeight(e.path, e.offset, e.nbytes, e.dtype, e.shape) for e in entries]
        views = [m.tensor for m in self._last]
        if len(views) == 1 and views[0].dtype == dtype:
            return views[0]
        shape = [sum(v.shape[0] for v in views), *views[0].shape[1:]]
        n = math.prod(shape)
        if self._scratch is None or self._scratch.dtype != dtype or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=dtype)
        out, start = self._scratch[:n].view(shape), 0
        for v in views:  # copy_ converts the dtype where it differs
            out[start : start + v.shape[0]].copy_(v)
            start += v.shape[0]
        return out

    def release(self) -> None:
        """Give back the mapped pages of the weight handed out last."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for m in self._last:
                m.drop_pages()
        self._last = []

    def close(self) -> None:
        """Pages back, scratch freed; each mapping goes when the last view of it does."""
        self.release()
        self._scratch = None

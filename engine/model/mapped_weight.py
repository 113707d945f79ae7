"""A weight used only by gather (the token embedding), mapped from its safetensors file, not read.

Why: a gather touches a few rows per token, so a mapped embedding keeps resident only the rows of the
tokens seen, as file pages the kernel can drop and read again; read into memory, it would be vocab x
hidden floats of the scheduler whatever the prompts. Mapped copy-on-write: nothing the engine does
can write to the file. A layer that reads the whole weight at load (a tied lm_head packed or
quantized from it) faults every page in once; drop_pages() then gives them back. As with llama.cpp's
mapped GGUF, the file must not be truncated while the engine runs (its pages would fault).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch


class MappedWeight:
    """One tensor's bytes in a private, copy-on-write mapping of its file; .tensor views them."""

    def __init__(
        self, path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]
    ) -> None:
        # the tensor's range only, from an aligned start
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f:
            if offset + nbytes > f.seek(0, 2):
                raise ValueError(f"{path.name} is truncated")
            self._map = mmap.mmap(
                f.fileno(), offset + nbytes - start, offset=start, access=mmap.ACCESS_COPY
            )
        count = nbytes // torch.empty((), dtype=dtype).element_size()
        self.tensor = torch.frombuffer(
            self._map, dtype=dtype, count=count, offset=offset - start
        ).view(shape)

    def drop_pages(self) -> None:
        """Unmap the resident pages of the tensor (the next gather of a row reads it from the page cache).
        A page written to since (copy-on-write) would be lost with them: nothing writes the embedding."""
        self._map.madvise(mmap.MADV_DONTNEED)


def mappable(entry_dtype: torch.dtype, dtype: torch.dtype, parts: int, device: str) -> bool:
    """Mapped only where the file's bytes are the tensor as the model keeps it: one part, the same dtype,
    on the CPU, on a system with madvise (Linux, macOS)."""
    return (
        parts == 1
        and entry_dtype == dtype
        and torch.device(device).type == "cpu"
        and hasattr(mmap, "MADV_DONTNEED")
    )

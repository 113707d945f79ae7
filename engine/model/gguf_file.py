"""Where each tensor of a GGUF file lies, and reading one tensor's raw blocks: no more than that.

Why not gguf's GGUFReader: it parses every metadata value into numpy views (seconds for a large
vocabulary), while quantization='gguf' needs only the tensor index (milliseconds).
The format (GGUF v2/v3, little-endian): magic, version, tensor and key-value counts, the key-values,
then per tensor its name, dims, ggml type and offset into the data section, which starts at the next
multiple of general.alignment (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# value type -> bytes
SCALAR_SIZES = {
    0: 1,
    1: 1,
    2: 2,
    3: 2,
    4: 4,
    5: 4,
    6: 4,
    7: 1,
    10: 8,
    11: 8,
    12: 8,
}
STRING, ARRAY, UINT32 = 8, 9, 4


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: int  # ggml type id
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous one
    offset: int  # absolute, in the file


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.take("Q")
        text = self.data[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def skip_value(self, kind: int) -> None:
        if kind in SCALAR_SIZES:
            self.pos += SCALAR_SIZES[kind]
        elif kind == STRING:
            # not `self.pos += self.take(...)`: that would add to the position before the length
            n = self.take("Q")
            self.pos += n
        elif kind == ARRAY:
            inner, count = self.take("IQ")
            if inner in SCALAR_SIZES:
                self.pos += SCALAR_SIZES[inner] * count
            elif inner == STRING:  # a vocabulary: 49k strings here, one length each to step over
                data, pos, unpack = self.data, self.pos, struct.unpack_from
                for _ in range(count):
                    pos += 8 + unpack("<Q", data, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def read_index(path: Path) -> dict[str, GGUFTensor]:
    """name -> GGUFTensor. ValueError naming the file when it is not a GGUF this reader understands."""
    data = path.read_bytes() if path.stat().st_size < (1 << 20) else _head(path)
    try:
        c = _Cursor(data)
        if data[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        c.pos = 4
        version, n_tensors, n_kv = c.take("IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        alignment = 32
        for _ in range(n_kv):
            key, kind = c.string(), c.take("I")
            if key == "general.alignment":
                if kind != UINT32:
                    raise ValueError(f"general.alignment has value type {kind}, not uint32")
                alignment = c.take("I")
                if alignment <= 0 or alignment & (alignment - 1):
                    raise ValueError(f"general.alignment {alignment} is not a power of two")
            else:
                c.skip_value(kind)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = c.string(), c.take("I")
            dims = tuple(c.take("Q") for _ in range(n_dims))
            kind, offset = c.take("IQ")
            infos.append((name, kind, dims, offset))
    except (struct.error, IndexError, OverflowError, UnicodeDecodeError, RecursionError) as exc:
        more = (
            " (or its metadata is larger than the 16 MB read)"
            if len(data) < path.stat().st_size
            else ""
        )
        raise ValueError(f"{path.name} is not a readable GGUF file{more}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from None
    start = -(-c.pos // alignment) * alignment
    return {n: GGUFTensor(n, k, d, start + o) for n, k, d, o in infos}


def _head(path: Path, size: int = 16 << 20) -> bytes:
    """The file's first bytes, enough for metadata and index (a vocabulary of 150k tokens is ~4 MB)."""
    with open(path, "rb") as f:
        return f.read(size)


def read_tensor(path: Path, tensor: GGUFTensor, row_bytes: int) -> torch.Tensor:
    """The tensor's raw bytes as uint8 [rows, row_bytes], rows being the product of dims[1:]; a ValueError
    naming the file when they do not lie inside it (checked before anything is allocated)."""
    rows = 1
    for d in tensor.dims[1:]:
        rows *= d
    if tensor.offset + rows * row_bytes > path.stat().st_size:
        raise ValueError(
            f"{path.name}: tensor {tensor.name} ({rows} x {row_bytes} bytes at {tensor.offset}) lies "
            "outside the file"
        )
    out = torch.empty(rows, row_bytes, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(tensor.offset)
        if f.readinto(memoryview(out.numpy()).cast("B")) != out.numel():
            raise ValueError(f"{path.name}: tensor {tensor.name} is truncated")
    return out

"""Reading and writing safetensors files our own way: the tensors' places from the header (so a weight can
be read into place or mapped, never copied whole), and a writer that streams each tensor from its own memory.

Why our own: safetensors' save_file copies every tensor into bytes first (the whole file's size more for
float32 panels, engine/linear/panel_cache.py), and its loaders read or copy where the engine maps
(engine/model/mapped_weight.py). The format: an 8-byte little-endian header length, the JSON header
(name -> dtype, shape, data_offsets; "__metadata__": str -> str), then the data.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20  # bytes: a larger header is not one this engine reads


class TensorEntry:
    __slots__ = ("path", "offset", "nbytes", "dtype", "shape")

    def __init__(
        self, path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]
    ) -> None:
        self.path, self.offset, self.nbytes, self.dtype, self.shape = (
            path,
            offset,
            nbytes,
            dtype,
            shape,
        )


def _header(path: Path) -> tuple[dict, int, int]:
    """(header, where the data starts, file size); ValueError naming what does not fit."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            if not 0 < length <= min(size - 8, MAX_HEADER):
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(f.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except ValueError as exc:  # JSONDecodeError included
            raise ValueError(f"{path} is not a valid safetensors file: {exc}") from None
    return header, 8 + length, size


def index_file(path: Path) -> dict[str, TensorEntry]:
    """Where each tensor of one safetensors file lies, its byte count checked against its shape.
    ValueError naming what does not fit."""
    header, base, size = _header(path)
    entries: dict[str, TensorEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, (start, end), shape = (
                meta["dtype"],
                meta["data_offsets"],
                [int(d) for d in meta["shape"]],
            )
            if not (
                isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size - base
            ):
                raise ValueError(f"{name} lies outside the file")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{path} is not a valid safetensors file: entry {name!r}: {exc!r}"
            ) from None
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        torch_dtype = SAFETENSORS_DTYPES[dtype]
        if end - start != math.prod(shape) * torch_dtype.itemsize:
            raise ValueError(
                f"{path.name}: tensor {name} has {end - start} bytes for its shape {shape} of {dtype}"
            )
        entries[name] = TensorEntry(path, base + start, end - start, torch_dtype, shape)
    return entries


def read_metadata(path: Path) -> dict | None:
    """The file's __metadata__, or None where it has none or is not a safetensors file."""
    try:
        meta = _header(path)[0].get("__metadata__")
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """tensors (CPU) as a safetensors file, each written from its own memory."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)

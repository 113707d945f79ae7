"""The token embedding mapped from its safetensors file (engine/model/mapped_weight.py): the file's values,
in a private mapping of the file, resident only where gathered, never written back."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from engine.model.config import load_hf_config
from engine.linear import f32_panels
from engine.linear.f32_panels import F32Linear
from engine.linear.torch import Linear
from engine.model.loader import index_weights, load_model
from engine.model.mapped_weight import MappedWeight, mappable
from engine.linear.onednn import PackedLinear, packing_available
from engine.kernels.cpu import load_native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _mapped_file(address: int) -> str | None:
    """The file /proc/self/maps names for the mapping holding this address (None: anonymous memory)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        if lo <= address < hi:
            return os.path.realpath(fields[5]) if len(fields) > 5 else None
    return None


def _rss_file_mb() -> float:
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("RssFile:"))
    return int(line.split()[1]) / 1024


def test_loader_maps_the_float32_embedding_and_reads_the_rest(tiny_llama_dir):
    if not packing_available(torch.float32, "cpu"):
        pytest.skip(
            "float32 is not packed on this CPU: the tied lm_head reads the embedding (next test)"
        )
    model, _ = load_model(tiny_llama_dir, load_hf_config(tiny_llama_dir), torch.float32, "cpu", 64)
    weights = index_weights(tiny_llama_dir)
    entry = weights["model.embed_tokens.weight"]
    embed, file = model.embed_tokens.weight, os.path.realpath(entry.path)
    ours = f32_panels.runs_here(load_native())
    # AVX-512: MKL's
    kind = (
        (F32Linear if ours else PackedLinear)
        if torch.backends.cpu.get_cpu_capability() == "AVX2"
        else Linear
    )
    assert _mapped_file(embed.data_ptr()) == file and type(model.lm_head) is kind  # its own copy
    assert _mapped_file(getattr(model.lm_head, "weight", model.norm.weight).data_ptr()) != file
    assert _mapped_file(model.norm.weight.data_ptr()) != file  # read into memory
    with open(entry.path, "rb") as f:
        f.seek(entry.offset)
        on_disk = torch.frombuffer(bytearray(f.read(entry.nbytes)), dtype=torch.float32).view(
            entry.shape
        )
    assert torch.equal(embed, on_disk)
    ids = torch.tensor([[0, 5, entry.shape[0] - 1]])
    assert torch.equal(model.embed_tokens(ids), on_disk[ids])
    bf16, _ = load_model(tiny_llama_dir, load_hf_config(tiny_llama_dir), torch.bfloat16, "cpu", 64)
    assert _mapped_file(bf16.embed_tokens.weight.data_ptr()) != file  # converted: read
    assert torch.equal(bf16.embed_tokens.weight, on_disk.bfloat16())


def test_a_tied_lm_head_left_plain_reads_the_embedding_into_memory(tiny_llama_dir, monkeypatch):
    """Unpacked (the table's torch-plain row, or float32 on an AVX-512 CPU) the tied lm_head multiplies the
    embedding itself every step: mapped, that would stream file pages; it is read instead. Quantized, the
    lm_head has its own weights and the embedding is mapped again."""
    file = os.path.realpath(index_weights(tiny_llama_dir)["model.embed_tokens.weight"].path)
    plain = {"torch-plain": "on"}
    model, _ = load_model(
        tiny_llama_dir,
        load_hf_config(tiny_llama_dir),
        torch.float32,
        "cpu",
        64,
        kernel_overrides=plain,
    )
    assert model.lm_head.weight is model.embed_tokens.weight
    assert _mapped_file(model.embed_tokens.weight.data_ptr()) != file
    if load_native() is None:
        pytest.skip("no C compiler: no quantized mode")
    model, _ = load_model(
        tiny_llama_dir,
        load_hf_config(tiny_llama_dir),
        torch.float32,
        "cpu",
        64,
        quantization="int8",
    )
    assert _mapped_file(model.embed_tokens.weight.data_ptr()) == file


def test_mapping_is_only_resident_where_touched_and_gives_pages_back(tmp_path):
    rows, hidden = 16384, 1024  # 64 MB of float32
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(rows * hidden, dtype=torch.float32).view(rows, hidden)}, str(path))
    entry = index_weights(str(tmp_path))["w"]
    before = _rss_file_mb()
    mapped = MappedWeight(entry.path, entry.offset, entry.nbytes, entry.dtype, entry.shape)
    assert torch.equal(
        mapped.tensor[[3, 9000]], torch.tensor([[3.0], [9000.0]]) * hidden + torch.arange(hidden)
    )
    assert _rss_file_mb() - before < 8  # two rows gathered: a few pages, not the file
    assert float(mapped.tensor.sum(dtype=torch.float64)) == pytest.approx(
        (rows * hidden) * (rows * hidden - 1) / 2
    )
    # all of it read once (a packed or quantized lm_head's load)
    assert _rss_file_mb() - before > 56
    mapped.drop_pages()
    assert _rss_file_mb() - before < 8
    # read again from the page cache
    assert float(mapped.tensor[rows - 1, hidden - 1]) == rows * hidden - 1


def test_mapping_is_copy_on_write(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(4, 8)}, str(path))
    before = path.read_bytes()
    entry = index_weights(str(tmp_path))["w"]
    mapped = MappedWeight(entry.path, entry.offset, entry.nbytes, entry.dtype, entry.shape)
    mapped.tensor[0, 0] = 42.0
    assert float(mapped.tensor[0, 0]) == 42.0 and path.read_bytes() == before


def test_mapped_only_where_the_bytes_are_the_tensor():
    assert mappable(torch.float32, torch.float32, 1, "cpu")
    assert not mappable(torch.float32, torch.bfloat16, 1, "cpu")  # converted at load
    assert not mappable(torch.float32, torch.float32, 2, "cpu")  # parts stacked into one tensor
    assert not mappable(torch.float32, torch.float32, 1, "meta")

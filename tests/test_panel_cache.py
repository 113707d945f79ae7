"""The exact float32 mode's panels kept on disk (engine/linear/panel_cache.py) and the cache files' upkeep
(engine/quantization/cache.py): a second load maps the panels the first packed, never reading the layers'
weights, and computes the same bits; a damaged or ill-fitting file is packed again and replaced; files a
newer one replaces, or whose model directory is gone, are removed."""

from __future__ import annotations

import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file

from engine.model import weight_views
from engine.model.config import load_hf_config
from engine.linear.f32_panels import F32Linear
from engine.model.loader import load_model
from engine.linear.panel_cache import mapped_panels, panel_file
from engine.model.safetensors_io import read_metadata, write_safetensors
from engine.quantization import cache


def _load(model_dir: str, cached: bool = True):
    overrides = {"f32-panels-cached": "on"} if cached else {}  # an opt-in row of the choice table
    model, _ = load_model(
        model_dir, load_hf_config(model_dir), torch.float32, "cpu", 64, kernel_overrides=overrides
    )
    return {name: m for name, m in model.named_modules() if isinstance(m, F32Linear)}


def test_float32_panels_come_back_mapped_from_the_cache(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    first = _load(tiny_llama_dir)
    path = panel_file(tiny_llama_dir)
    # float32 is not on our kernel here (AVX-512 keeps MKL, or no compiler): nothing kept
    if not first:
        assert not path.exists()
        pytest.skip(
            "float32 layers do not run on f32_linear on this CPU: checked that no panels are kept"
        )
    assert path.exists() and set(load_file(str(path))) == set(first)
    stamp = path.stat().st_mtime_ns

    def no_reads(*args, **kwargs):
        raise AssertionError("a layer's weight was read although its panels were cached")

    with monkeypatch.context() as m:
        m.setattr(weight_views.WeightViews, "stacked", no_reads)
        second = _load(tiny_llama_dir)
    assert set(second) == set(first) and path.stat().st_mtime_ns == stamp  # mapped, not rewritten
    x = torch.randn(5, next(iter(first.values())).in_features)
    for name, layer in first.items():
        assert torch.equal(second[name].packed, layer.packed), name
        rows = x if layer.in_features == x.shape[1] else torch.randn(5, layer.in_features)
        assert torch.equal(second[name](rows), layer(rows)), name

    path.write_bytes(b"not safetensors")  # damaged: packed again and replaced
    third = _load(tiny_llama_dir)
    assert all(torch.equal(third[n].packed, first[n].packed) for n in first)
    assert set(load_file(str(path))) == set(first)

    path.unlink()  # off by default: packed at every start, nothing read or written
    assert set(_load(tiny_llama_dir, cached=False)) == set(first) and not path.exists()


def test_the_cached_layout_is_f32_linear_s_panels():
    """panel p, k, j holds W[16 p + j, k]: if f32_linear.c's packing ever changes, panel_cache.FORMAT must be
    bumped (older files would otherwise pass the shape checks)."""
    from engine.kernels.cpu import load_native
    from engine.linear import f32_panels

    lib = load_native()
    if not f32_panels.runs_here(lib):
        pytest.skip("f32_linear is not built for this CPU")
    linear = torch.nn.Linear(24, 48, bias=False)
    packed = F32Linear(linear, lib).packed.view(3, 24, 16)
    assert torch.equal(packed, linear.weight.detach().view(3, 16, 24).transpose(1, 2))


def test_panels_that_do_not_fit_are_not_used(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    shapes = {"lm_head": (64, 32), "layers.0.mlp.down_proj": (32, 48)}
    path = panel_file(tiny_llama_dir)
    path.parent.mkdir(parents=True)
    write_safetensors(
        str(path), {"lm_head": torch.zeros(64 * 32), "layers.0.mlp.down_proj": torch.zeros(32 * 48)}
    )
    assert set(mapped_panels(tiny_llama_dir, shapes)) == set(shapes)
    for wrong in (
        {"lm_head": torch.zeros(64 * 31)},
        {"lm_head": torch.zeros(64, 32)},
        {"lm_head": torch.zeros(64 * 32, dtype=torch.float64)},
        {"not_a_layer": torch.zeros(4)},
    ):
        write_safetensors(str(path), wrong)
        assert mapped_panels(tiny_llama_dir, shapes) is None, wrong


def test_our_safetensors_writer_is_read_by_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randint(-127, 128, (2, 7, 16), dtype=torch.int8),
        "c": torch.randn(4)[::2],
    }
    write_safetensors(str(tmp_path / "t.safetensors"), tensors, {"model_dir": "/x", "mode": "m"})
    back = load_file(str(tmp_path / "t.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    assert read_metadata(tmp_path / "t.safetensors") == {"model_dir": "/x", "mode": "m"}


def test_a_new_cache_file_removes_the_ones_it_replaces(tmp_path, monkeypatch):
    """Kept: other modes of the model, other models (one of the same folder name), another host's files.
    Removed: the same model and mode under another key (its files changed), the same model files in an
    older format (before the metadata: known by that name), and this host's files of model folders gone."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    model, other, gone, twin = (
        tmp_path / name for name in ("model", "other", "gone", "elsewhere/model")
    )
    for folder in (model, other, gone, twin):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    one = {"w": torch.zeros(4)}
    folder = cache.cache_dir()
    folder.mkdir(parents=True)
    here = socket.gethostname()

    def written(name: str, source, mode: str, host: str = here):
        meta = {"model_dir": str(source.resolve()), "mode": mode, "host": host}
        write_safetensors(str(folder / name), one, meta)
        return folder / name

    older = written("model-int8-0000.safetensors", model, "int8")
    legacy = cache.cache_file(str(model), "int8", fmt=1)  # format 1, before the metadata
    write_safetensors(str(legacy), one)
    # no metadata, not a name this model's files give
    unknown = folder / "model-int8-1111.safetensors"
    write_safetensors(str(unknown), one)
    kept = [
        written("model-float32-panels-2222.safetensors", model, "float32-panels"),
        written("other-int8-3333.safetensors", other, "int8"),
        written("model-int8-5555.safetensors", twin, "int8"),
        written("gone-int8-6666.safetensors", gone, "int8", host="another-host"),
        unknown,
    ]
    orphan = written("gone-int8-4444.safetensors", gone, "int8")
    shutil.rmtree(gone)
    path = cache.cache_file(str(model), "int8")
    cache.save_cached(path, one, str(model), "int8")
    assert path.exists() and read_metadata(path) == {
        "model_dir": str(model.resolve()),
        "mode": "int8",
        "host": here,
    }
    assert all(p.exists() for p in kept), [p.name for p in kept if not p.exists()]
    assert not older.exists() and not legacy.exists() and not orphan.exists()

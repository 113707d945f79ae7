"""The converted directories of GGUFs (517 MB each for the embedded model) are removed when a new conversion
replaces them, with the cache files made from them; nothing else in the cache folder is touched."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from engine.model.embedded import conversion_source, install_conversion, prune_conversions
from engine.model.safetensors_io import read_metadata, write_safetensors
from engine.quantization import cache
from engine.linear.gguf import gguf_source

HEX = "0123456789abcdef"


def _conversion(root: Path, name: str, gguf: Path, host: str | None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / ".complete").write_text(str(gguf))
    if host:
        (folder / ".host").write_text(host)
    return folder


def _cached(
    folder: Path, mode: str = "int8", kind: str = "quantized", host: str | None = None
) -> Path:
    path = cache.cache_file(str(folder), mode, kind=kind)
    cache.save_cached(path, {"w": torch.zeros(4)}, str(folder), mode)
    if host:  # as another host sharing this home would have written it
        write_safetensors(str(path), {"w": torch.zeros(4)}, {**read_metadata(path), "host": host})
    return path


def test_a_conversion_removes_this_hosts_conversions_it_replaces_and_nothing_else(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    root, here = tmp_path / "cache", socket.gethostname()
    model, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"GGUF"), other.write_bytes(b"GGUF")
    # removed with its environment
    installed = tmp_path / "venv" / "lib" / "site-packages" / "pkg" / "gone.gguf"
    unmounted = tmp_path / "drive" / "mine.gguf"  # a user's own file that is missing now
    kept = _conversion(root, "model-" + HEX, model, here)
    removed = [
        _conversion(root, "model-" + "1" * 16, model, here),  # the same file's older conversion
        _conversion(root, "model-" + "2" * 16, model, None),  # ... before the host was recorded
        _conversion(root, "gone-" + "3" * 16, installed, here),
        _conversion(root, "gone-" + "4" * 16, installed, None),
    ]
    outside = _conversion(tmp_path / "elsewhere", "linked", installed, here)
    survivors = [
        # a shared home: another host's venv
        _conversion(root, "model-" + "5" * 16, model, "other-host"),
        _conversion(root, "gone-" + "6" * 16, installed, "other-host"),
        _conversion(root, "mine-" + "7" * 16, unmounted, here),
        _conversion(root, "other-" + "8" * 16, other, None),
        _conversion(root, "user-model", installed, here),  # not named as ours
        # marked just before its rename: in progress
        _conversion(root, ".convert-k2j4h5g6", model, here),
        root / ("model-" + "9" * 16),  # no mark yet
        root / "quantized",
        root / ("link-" + "a" * 16),
        # installed, still there
        _conversion(root, "kept-" + "c" * 16, installed.with_name("present.gguf"), here),
        _conversion(root, ".model-" + "d" * 16, model, here),  # a hidden folder is never ours
    ]
    installed.parent.mkdir(parents=True)
    installed.with_name("present.gguf").write_bytes(b"GGUF")
    survivors[6].mkdir()
    survivors[8].symlink_to(outside, target_is_directory=True)
    (root / (".prune-model-" + "b" * 16)).mkdir()  # a removal cut short
    (root / ".prune-notes").mkdir()  # a user's: not named as a removal of ours
    files = {folder: _cached(folder) for folder in (kept, removed[0], removed[2], survivors[3])}
    panels = {folder: _cached(folder, "float32-panels", "packed") for folder in (kept, removed[2])}
    foreign = _cached(removed[3], host="other-host")
    # no metadata: not judged here
    legacy = root / "quantized" / "unknown-int8-0000000000000000.safetensors"
    legacy.write_bytes(b"\0" * 16)

    assert sorted(prune_conversions(kept)) == sorted(removed)
    assert not any(p.exists() for p in removed) and kept.is_dir() and outside.is_dir()
    assert all(p.exists() or p.is_symlink() for p in survivors)
    assert [p.name for p in root.iterdir() if p.name.startswith(".prune-")] == [".prune-notes"]
    for kind in ("quantized", "packed"):
        cache.prune_orphans(kind)
    assert files[kept].exists() and files[survivors[3]].exists() and panels[kept].exists()
    assert (
        not files[removed[0]].exists()
        and not files[removed[2]].exists()
        and not panels[removed[2]].exists()
    )
    assert foreign.exists() and legacy.exists()  # another host's file is its own to judge


def test_installing_a_conversion_marks_it_readably_and_prunes_what_it_replaces(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    root, gguf = tmp_path / "cache", tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    older = _conversion(root, "m-" + "1" * 16, gguf, socket.gethostname())
    int8, panels = _cached(older), _cached(older, "float32-panels", "packed")
    assert int8.exists() and panels.exists()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text("{}")
    target = root / ("m-" + HEX)
    install_conversion(fresh, target, gguf)
    assert not fresh.exists() and not older.exists() and not int8.exists() and not panels.exists()
    # one line, as engines before the host was recorded read it (they took the whole text for the path)
    assert (target / ".complete").read_text() == str(gguf.resolve())
    assert conversion_source(target) == (str(gguf.resolve()), socket.gethostname())
    assert gguf_source(str(target)) == gguf.resolve()


def test_the_mark_names_a_gguf_or_the_folder_is_no_conversion(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    old = _conversion(tmp_path, "m-" + "2" * 16, gguf, None)
    assert conversion_source(old) == (str(gguf), None) and gguf_source(str(old)) == gguf
    # as one commit of this project wrote it
    two_lines = _conversion(tmp_path, "m-" + "4" * 16, gguf, None)
    (two_lines / ".complete").write_text(f"{gguf}\nhost-b\n")
    assert (
        conversion_source(two_lines) == (str(gguf), "host-b")
        and gguf_source(str(two_lines)) == gguf
    )
    bad = _conversion(tmp_path, "m-" + "3" * 16, tmp_path / "not-a-model.bin", "host-a")
    assert conversion_source(bad) is None and gguf_source(str(bad)) is None
    # a folder that is no conversion prunes nothing
    assert prune_conversions(bad) == [] and old.is_dir()


def test_a_neighbour_pruning_cannot_read_never_fails_the_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    root, gguf = tmp_path / "cache", tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    broken = root / ("m-" + "5" * 16)
    broken.mkdir(parents=True)
    # read_text raises UnicodeDecodeError, not OSError
    (broken / ".complete").write_bytes(b"\xff\xfe not text")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    install_conversion(fresh, root / ("m-" + HEX), gguf)
    assert conversion_source(root / ("m-" + HEX)) is not None and broken.is_dir()


def test_leftovers_of_a_killed_conversion_or_cache_write_are_removed_once_stale(
    tmp_path, monkeypatch
):
    """A conversion, a cache file's write or a kernel build killed midway (SIGKILL, the OOM killer, a
    closed terminal) left its temporary folder or file for good: 514 MB a killed conversion of the
    embedded model. Those older than a day go with the next upkeep of their folder; younger ones may
    be another process's work in progress, and stay."""
    import os
    import time

    from engine.cache_upkeep import STALE_SECONDS

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    root, gguf = tmp_path / "cache", tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    root.mkdir()
    old, young = root / ".convert-killed1", root / ".convert-running"
    for folder in (old, young):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 100)
    stale = time.time() - STALE_SECONDS - 60
    os.utime(old, (stale, stale))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text("{}")
    install_conversion(fresh, root / ("m-" + HEX), gguf)
    assert not old.exists() and young.exists()
    # a cache file's write: tmp*.tmp beside the cache files
    kept = _cached(root / ("m-" + HEX))
    old_tmp, young_tmp = kept.parent / "tmpkilled.tmp", kept.parent / "tmprunning.tmp"
    for f in (old_tmp, young_tmp):
        f.write_bytes(b"x")
    os.utime(old_tmp, (stale, stale))
    _cached(root / ("m-" + HEX))
    assert not old_tmp.exists() and young_tmp.exists()


def test_a_conversion_is_on_disk_before_it_is_marked_complete(tmp_path, monkeypatch):
    """The `.complete` mark is all a later start trusts: with nothing synced, a power cut could leave a
    folder marked complete around an empty or truncated model.safetensors, failing every start after."""
    import os

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    root, gguf = tmp_path / "cache", tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text("{}")
    (fresh / "model.safetensors").write_bytes(b"x" * 100)
    root.mkdir()
    synced: dict[str, bool] = {}
    real = os.fsync

    def fsync(fd):
        synced[os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))] = (
            fresh / ".complete"
        ).exists()
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    install_conversion(fresh, root / ("m-" + HEX), gguf)
    # before the mark
    assert synced.get("model.safetensors") is False and synced.get("config.json") is False, synced
    # the folder's entries, and the mark itself
    assert "fresh" in synced and ".complete" in synced, synced


def test_a_conversion_an_engine_is_running_on_is_not_removed(tmp_path, monkeypatch):
    """A reinstall (the GGUF's time changed) made the next engine's conversion remove the folder a running
    engine was started from; that engine reads it again later (transformers' tokenizer on the first chat
    request, the grammar compiler's on the first constrained one), which then failed until a restart.
    A running engine holds a shared lease on its conversion; a folder leased is left for a later upkeep."""
    from engine.cache_upkeep import hold_lease

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    root, gguf = tmp_path / "cache", tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    running = _conversion(root, "m-" + "1" * 16, gguf, socket.gethostname())
    lease = hold_lease(running)
    assert lease is not None
    try:
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        (fresh / "config.json").write_text("{}")
        install_conversion(fresh, root / ("m-" + HEX), gguf)
        assert running.exists() and conversion_source(running) is not None
    finally:
        lease.close()
    assert prune_conversions(root / ("m-" + HEX)) == [running] and not running.exists()


def test_a_running_engine_holds_its_conversions_lease(engine):
    from engine.cache_upkeep import unleased

    assert (Path(engine.model_dir) / ".complete").exists()  # the embedded model, converted
    assert unleased(Path(engine.model_dir)) is None

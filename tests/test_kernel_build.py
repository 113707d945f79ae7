"""Issue 13, items 5, 6 and 9: how the native kernels are built and loaded. Each case builds in a
fresh subprocess with its own cache directory (a build takes about a second)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_cc = pytest.mark.skipif(
    not any(
        os.access(os.path.join(d, "cc"), os.X_OK)
        for d in os.environ.get("PATH", "").split(os.pathsep)
    ),
    reason="no C compiler",
)


def _python(code: str, cache: Path, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "ENGINE_CACHE_DIR": str(cache), "ENGINE_NATIVE_KERNELS": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_cc
def test_loading_the_kernels_keeps_denormals(tmp_path):
    """-ffast-math links crtfastmath, which sets flush-to-zero for the process that loads the library."""
    code = (
        "import torch\n"
        "from engine.kernels.cpu import load_native\n"
        "assert load_native() is not None, 'the kernels did not build'\n"
        "x = torch.tensor([1e-40], dtype=torch.float32)\n"
        "assert (x * 1.0).item() != 0.0, 'float32 denormal flushed to zero'\n"
        "d = 1e-310\n"
        "assert d * 1.0 != 0.0, 'float64 denormal flushed to zero'\n"
        "print('ok')\n"
    )
    res = _python(code, tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@needs_cc
@pytest.mark.parametrize("cc", ["env cc", "  cc  ", "no-such-compiler-xyz", "env false"])
def test_cc_with_arguments_builds_or_falls_back_cleanly(tmp_path, cc):
    """CC is split as a shell would; a compiler that is missing or fails means torch, and leaves nothing."""
    code = "from engine.kernels.cpu import load_native\nprint(load_native() is not None)\n"
    res = _python(code, tmp_path, CC=cc)
    assert res.returncode == 0, res.stderr
    works = cc.strip().split()[-1] == "cc"
    assert res.stdout.strip() == str(works)
    files = (
        sorted(p.name for p in (tmp_path / "kernels").iterdir())
        if (tmp_path / "kernels").exists()
        else []
    )
    if works:
        assert (
            len(files) == 1 and files[0].startswith("cpu_kernels-") and files[0].endswith(".so")
        ), files
    else:
        assert files == [], files  # no 0-byte tmp*.so left behind


@needs_cc
def test_failed_builds_leave_no_temporary_files(tmp_path):
    code = (
        "from engine.kernels.cpu import load_native\n"
        "from engine.kernels.attention import create_backend\n"
        "print(load_native() is None)\n"
    )
    for _ in range(2):
        assert _python(code, tmp_path, CC="env false").stdout.strip() == "True"
    assert list((tmp_path / "kernels").iterdir()) == []


PLANT = (
    "import ctypes, os, sys\n"
    "from engine.kernels.cpu import build\n"
    "lib = build.load_native()\n"
    "assert lib is not None\n"
    "print('planted' if hasattr(lib, 'planted') else 'built')\n"
)


def _plant(folder: Path, tmp_path: Path) -> Path:
    """A library with an extra symbol under the name the cache would use, as another user could plant it."""
    key_code = "from engine.kernels.cpu import build\nprint(build.cache_key())\n"
    key = _python(key_code, tmp_path).stdout.strip()
    source = tmp_path / "planted.c"
    # beside every real kernel, so the library binds
    source.write_text("int planted(void) { return 1; }\n")
    target = folder / f"cpu_kernels-{key}.so"
    kernels = sorted(str(p) for p in (ROOT / "engine/kernels/cpu").glob("*.c"))
    subprocess.run(
        [
            "cc",
            "-O1",
            "-fopenmp",
            "-shared",
            "-fPIC",
            *kernels,
            str(source),
            "-o",
            str(target),
            "-lm",
        ],
        check=True,
    )
    return target


@needs_cc
def test_world_writable_cache_directory_is_not_trusted(tmp_path):
    cache = tmp_path / "shared-cache"
    (cache / "kernels").mkdir(parents=True)
    os.chmod(cache, 0o777)
    os.chmod(cache / "kernels", 0o777)
    _plant(cache / "kernels", tmp_path)
    res = _python(PLANT, cache)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "built"  # the planted library was not loaded
    assert (
        "not using the kernel cache" in res.stderr and "writable by group or others" in res.stderr
    )
    assert sorted(p.name.startswith("cpu_kernels-") for p in (cache / "kernels").iterdir()) == [
        True
    ]


@needs_cc
def test_world_writable_library_in_a_private_cache_is_rebuilt(tmp_path):
    (tmp_path / "kernels").mkdir(mode=0o700)
    target = _plant(tmp_path / "kernels", tmp_path)
    os.chmod(target, 0o666)
    res = _python(PLANT, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "built"
    assert not stat.S_IMODE(target.stat().st_mode) & 0o022  # replaced by this user's own build


@needs_cc
def test_a_private_cache_is_used(tmp_path):
    (tmp_path / "kernels").mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    # here "planted" by this user: trusted, as the cache is meant to be
    _plant(tmp_path / "kernels", tmp_path)
    res = _python(PLANT, tmp_path)
    assert res.stdout.strip() == "planted" and "not using the kernel cache" not in res.stderr, (
        res.stderr
    )


@needs_cc
def test_a_damaged_library_in_the_cache_is_rebuilt(tmp_path):
    """A library cut short (a crash or power loss as it was written) made every start fail with
    OSError: file too short, until someone deleted it by hand."""
    (tmp_path / "kernels").mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    target = _plant(tmp_path / "kernels", tmp_path)
    target.write_bytes(target.read_bytes()[:100])
    res = _python(PLANT, tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "built", res.stderr
    assert target.stat().st_size > 100


@needs_cc
def test_a_cached_library_is_used_where_no_compiler_is(tmp_path):
    """An image shipping a warm cache without a compiler (or with CC naming a missing one) ran without
    the kernels it had: the compiler was looked for before the cache."""
    (tmp_path / "kernels").mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    _plant(tmp_path / "kernels", tmp_path)
    res = _python(PLANT, tmp_path, CC="no-such-compiler-xyz")
    assert res.returncode == 0 and res.stdout.strip() == "planted", res.stderr


def test_cache_folders_the_engine_makes_are_private_under_a_group_umask(
    tmp_path, monkeypatch, tiny_llama_dir
):
    """mkdir's mode covers only the last folder: under umask 002 (Ubuntu's and Fedora's default for a
    user with a private group) the cache's root came out group-writable, and the engine, refusing a
    cache others may write, then refused its own: the int8 weights, the panels and the kernels were
    made again at every start. Every folder the engine makes is 0700 now."""
    import torch

    from engine.quantization.cache import cache_file, load_cached, save_cached

    root = tmp_path / "a" / "b"
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(root))
    old = os.umask(0o002)
    try:
        path = cache_file(tiny_llama_dir, "int8")
        save_cached(path, {"x": torch.ones(4)}, tiny_llama_dir, "int8")
    finally:
        os.umask(old)
    assert path.exists()
    for folder in (tmp_path / "a", root, path.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert load_cached(path) is not None

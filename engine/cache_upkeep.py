"""The cache folders' upkeep (the converted models, int8 weights, float32 panels, compiled kernels): folders
made private at every level, files on disk before they count as written, and what killed processes
left behind removed once it is stale."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import IO

STALE_SECONDS = 24 * 3600  # a temporary file or folder this old is no process's work in progress
LEASE = ".lease"  # in a converted model's folder: engines running on it hold a shared lock on it


def make_private_dirs(path: Path) -> None:
    """path and every missing folder above it, each 0700: mkdir's mode covers only the last, and a
    group-writable parent (umask 002) fails the caches' trust check (engine/kernels/cpu/build.py's
    unsafe_reason)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another process made it meanwhile
            pass


def sync_file(path: Path) -> None:
    """The file's data on disk (before a rename or a mark makes it count). A file system that cannot
    sync it (a directory on some FUSE, CIFS or 9p mounts: EINVAL) is left to its own devices."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EROFS):
            raise
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """Every file under folder, then each folder's entries, on disk."""
    # deepest first
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if not path.is_symlink() and (path.is_file() or path.is_dir()):
            sync_file(path)
    sync_file(folder)


def remove_stale(folder: Path, patterns: tuple[str, ...]) -> None:
    """Remove what matches patterns in folder and is older than STALE_SECONDS: the temporary files and
    folders of a conversion, a cache write or a kernel build whose process was killed (no `finally`
    runs on SIGKILL). Younger ones may be another process's work in progress."""
    cutoff = time.time() - STALE_SECONDS
    for pattern in patterns:
        for path in folder.glob(pattern):
            try:
                if path.is_symlink() or path.lstat().st_mtime > cutoff:
                    continue
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink()
            except OSError:
                pass


def hold_lease(folder: Path) -> IO | None:
    """A shared lock on folder's lease, held while the file stays open: an engine running on a converted
    model holds it, so that a newer conversion's upkeep does not remove the folder under it (the engine
    reads it again later: transformers' tokenizer, the grammar compiler's). None where it cannot be
    taken (a read-only folder): the engine runs without it."""
    # a removal holds it exclusively for a rename's time: waited for
    lease = _locked(folder, fcntl.LOCK_SH)
    # removed while we waited (renamed away)
    if lease is not None and not (folder / ".complete").exists():
        lease.close()
        return None
    return lease


def unleased(folder: Path) -> IO | None:
    """An exclusive lock on folder's lease when no engine holds it (keep it open while removing the
    folder); None while one does."""
    return _locked(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _locked(folder: Path, operation: int) -> IO | None:
    """folder's lease file, open and locked (flock `operation`); None where it cannot be."""
    try:
        lease = open(folder / LEASE, "a")
    except OSError:
        return None
    try:
        fcntl.flock(lease, operation)
    except OSError:
        lease.close()
        return None
    return lease

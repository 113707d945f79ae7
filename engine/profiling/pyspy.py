"""Running py-spy, and turning its failures into one line that says what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from engine import envvars


class ProfileError(Exception):
    """A failure the command reports in one line, exiting non-zero."""


def find_pyspy() -> str:
    """The py-spy binary: next to this interpreter (the py-spy wheel installs it there), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    chosen = envvars.read("ENGINE_PYSPY")  # an explicit binary
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise ProfileError(f"py-spy not found at ENGINE_PYSPY={chosen}")
        return chosen
    if os.path.exists(here):
        return here
    found = shutil.which("py-spy")
    if not found:
        raise ProfileError(
            "py-spy not found: install the engine's dependencies (pip install py-spy)"
        )
    return found


def explain(stderr: str, pid: int) -> str:
    """py-spy's error output -> one line."""
    text = stderr.strip()
    lowered = text.lower()
    if (
        "permission denied" in lowered
        or "operation not permitted" in lowered
        or "ptrace" in lowered
    ):
        return (
            f"py-spy is not permitted to read process {pid}: allow ptrace (sysctl kernel.yama.ptrace_scope=0, "
            "or run the container with --cap-add SYS_PTRACE), or run as root"
        )
    if "no such process" in lowered or "failed to find process" in lowered:
        return f"process {pid} is gone"
    last = text.splitlines()[-1] if text else "no output"
    return f"py-spy failed on process {pid}: {last}"


def record_args(
    pyspy: str, pid: int, out: str, rate: int, duration: float | None, idle: bool, native: bool
) -> list[str]:
    # --threads: each stack starts with its thread, so the breakdown shares out only the threads that
    # do the engine's work (an idle pool worker or exporter thread is neither work nor waiting on ZMQ)
    args = [
        pyspy,
        "record",
        "--pid",
        str(pid),
        "--format",
        "raw",
        "--output",
        out,
        "--rate",
        str(rate),
        "--threads",
    ]
    if not native:  # native unwinding needs the process paused while a sample is taken
        args.append("--nonblocking")
    if duration:
        args += ["--duration", str(max(1, int(round(duration))))]
    if idle:
        args.append("--idle")
    if native:
        args.append("--native")
    return args


def dump(pyspy: str, pid: int, timeout: float = 30.0) -> str:
    proc = subprocess.run(
        [pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise ProfileError(explain(proc.stderr + proc.stdout, pid))
    return proc.stdout

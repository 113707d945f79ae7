"""The engine's messages go through the `engine` logger (docs/configuration.md): with no logging
configured they reach stderr, from the user process and from the children, and the logger's level
set in the user process before the Engine starts silences them in all three processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PLUGIN = """
from engine.hooks import hookimpl


def _mark(what):
    with open("called.log", "a") as f:
        f.write(what + "\\n")


@hookimpl
def engine_step_end(step):  # the scheduler's, after the fact: its error is logged there
    _mark("step_end")
    raise RuntimeError("step_end broke")


@hookimpl
def engine_request_done(rid):  # the user process's, after the fact
    _mark("done")
    raise RuntimeError("done broke")
"""

SCRIPT = """
import logging
import sys

from engine import Engine

if __name__ == "__main__":
    if sys.argv[2] == "quiet":
        logging.getLogger("engine").setLevel(logging.CRITICAL)
    eng = Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=1024)
    eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0})
    eng.shutdown()
"""


@pytest.mark.parametrize("mode", ["default", "quiet"])
def test_engine_messages_reach_stderr_unless_the_engine_logger_is_silenced(
    tiny_llama_dir, tmp_path, mode
):
    (tmp_path / "noisy").mkdir()
    (tmp_path / "noisy" / "__init__.py").write_text("")
    (tmp_path / "noisy" / "plugin.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ENGINE_PLUGINS"] = "noisy.plugin"
    proc = subprocess.run(
        [sys.executable, "script.py", tiny_llama_dir, mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # both hooks failed
    assert set((tmp_path / "called.log").read_text().split()) == {
        "step_end",
        "done",
    }
    lines = proc.stderr.splitlines()
    scheduler = [
        ln for ln in lines if ln.startswith("engine::scheduler: ") and "step_end broke" in ln
    ]
    user = [ln for ln in lines if ln.startswith("engine: ") and "done broke" in ln]
    if mode == "default":
        assert scheduler and user, proc.stderr[-3000:]
    else:
        assert not scheduler and not user, proc.stderr[-3000:]

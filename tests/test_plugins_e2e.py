"""ENGINE_PLUGINS end to end, through real subprocesses with nothing else set: a plugin module next to
the user's script is active in all three processes; skipdetok gives ids and empty text; an unknown
name fails with the list of plugins; a user's own sitecustomize (the raw monkeypatch pattern) still
runs, alongside ours and on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from engine import Engine

    if __name__ == "__main__":
        with Engine(dtype="float32", max_total_tokens=2048) as engine:
            out = engine.generate("The capital of France is", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
            print("RESULT " + json.dumps({"text": out["text"], "ids": out["output_ids"], "pids": engine.pids}))
    """
)

PLUGIN = textwrap.dedent(
    """
    import os
    from engine import hooks
    from engine.hooks import hookimpl

    LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "active.log")

    @hookimpl
    def engine_process_ready(role, pid, info):
        with open(LOG, "a") as f:
            f.write(f"{role} {pid} {hooks.current_role()}\\n")
    """
)

USER_SITECUSTOMIZE = textwrap.dedent(
    """
    # a user's own sitecustomize: the raw monkeypatch pattern from the reference
    import os

    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize.log"), "a") as f:
        f.write(f"{os.getpid()}\\n")

    from engine.detokenizer.manager import DetokenizerManager

    _original = DetokenizerManager.detokenize

    def detokenize(self, out):
        text_out = _original(self, out)
        if text_out is not None:
            text_out.text_deltas = [t.upper() for t in text_out.text_deltas]
        return text_out

    DetokenizerManager.detokenize = detokenize
    """
)


def run(tmp_path, env_extra: dict) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "PYTHONPATH")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_plugin_is_active_in_all_three_processes_and_skipdetok_skips(tmp_path):
    pkg = tmp_path / "myplugin_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "myplugin.py").write_text(PLUGIN)
    out = result(run(tmp_path, {"ENGINE_PLUGINS": "myplugin_pkg.myplugin,skipdetok"}))
    lines = [l.split() for l in (pkg / "active.log").read_text().splitlines()]
    pids = out["pids"]
    assert sorted(lines) == sorted([["user", str(pids["user"]), "user"],
                                    ["scheduler", str(pids["scheduler"]), "scheduler"],
                                    ["detokenizer", str(pids["detokenizer"]), "detokenizer"]])  # fmt: skip
    assert out["text"] == "" and len(out["ids"]) == 6  # skipdetok: ids, no text


def test_unknown_plugin_fails_with_the_list(tmp_path):
    proc = run(tmp_path, {"ENGINE_PLUGINS": "no_such_plugin"})
    assert proc.returncode != 0
    assert "unknown plugin 'no_such_plugin'" in proc.stderr
    for name in ("skipdetok", "stagetimer", "no_repeat_ngram", "noop"):
        assert name in proc.stderr


def test_users_own_sitecustomize_runs_alongside_ours_and_alone(tmp_path):
    user_dir = tmp_path / "user_site"
    user_dir.mkdir()
    (user_dir / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    plain = result(run(tmp_path, {}))  # reference text, no sitecustomize of anyone
    alone = result(run(tmp_path, {"PYTHONPATH": str(user_dir)}))
    assert alone["text"] == plain["text"].upper() and alone["text"] != plain["text"]
    log = user_dir / "sitecustomize.log"
    log.unlink()
    proc = run(tmp_path, {"PYTHONPATH": str(user_dir), "ENGINE_PLUGINS": "stagetimer"})
    both = result(proc)
    assert both["text"] == plain["text"].upper()  # our sitecustomize chained to the user's
    assert "stagetimer: seconds per stage" in proc.stderr and "total" in proc.stderr  # its shutdown report
    ran_in = {int(p) for p in log.read_text().split()}
    assert {both["pids"]["user"], both["pids"]["scheduler"], both["pids"]["detokenizer"]} <= ran_in

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
            greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
            out = engine.generate("The capital of France is", greedy)
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


PROBE = textwrap.dedent(
    """
    # every process this plugin's code runs in, and the role it is told there, from its first line on
    import os
    from engine import hooks
    from engine.hooks import hookimpl

    def _log(what):
        with open(os.environ["PROBE_LOG"], "a") as f:
            f.write(f"{what} {os.getpid()} {hooks.current_role()}\\n")

    _log("import")

    @hookimpl
    def engine_logit_processors():
        _log("logit_processors")
        return {}
    """
)

WRAPPER_SCRIPT = textwrap.dedent(
    """
    import json
    from engine import Engine

    if __name__ == "__main__":
        with Engine(dtype="float32", max_total_tokens=2048) as engine:
            greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
            out = engine.generate("The capital of France is", greedy)
            stats = engine.get_stats()["plugins"]
            print("RESULT " + json.dumps({"text": out["text"], "ids": out["output_ids"], "pids": engine.pids,
                                          "meta": out["meta_info"], "stats": stats}))
    """
)


def run(tmp_path, env_extra: dict, script: str = SCRIPT) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_PLUGINS", "PYTHONPATH")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_plugin_is_active_in_all_three_processes_and_skipdetok_skips(tmp_path):
    """Also: stagetimer listed before skipdetok still times the detokenize stage (before the fix
    skipdetok's result, called first, stopped the firstresult hook before stagetimer's timer started)."""
    pkg = tmp_path / "myplugin_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "myplugin.py").write_text(PLUGIN)
    out = result(
        run(
            tmp_path,
            {"ENGINE_PLUGINS": "stagetimer,myplugin_pkg.myplugin,skipdetok"},
            WRAPPER_SCRIPT,
        )
    )
    lines = [ln.split() for ln in (pkg / "active.log").read_text().splitlines()]
    pids = out["pids"]
    assert sorted(lines) == sorted(
        [
            ["user", str(pids["user"]), "user"],
            ["scheduler", str(pids["scheduler"]), "scheduler"],
            ["detokenizer", str(pids["detokenizer"]), "detokenizer"],
        ]
    )
    assert out["text"] == "" and len(out["ids"]) == 6  # skipdetok: ids, no text
    timed = out["stats"]["detokenizer"]["stagetimer"]
    assert timed["calls"].get("detokenize", 0) >= 6 and timed["seconds"]["detokenize"] > 0, timed


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
    # its shutdown report
    assert "stagetimer: seconds per stage" in proc.stderr and "total" in proc.stderr
    ran_in = {int(p) for p in log.read_text().split()}
    assert {both["pids"]["user"], both["pids"]["scheduler"], both["pids"]["detokenizer"]} <= ran_in


def test_wrappers_run_in_all_three_processes_and_plugins_load_only_there(tmp_path):
    """The worked wrapper example of docs/plugins.md, loaded at interpreter start (its folder on
    PYTHONPATH, so the children's sitecustomize imports it), with a probe plugin that logs every
    process its code runs in and the role it is told there."""
    from docs_examples import write_example

    site = tmp_path / "site"
    module = write_example(site, "wrapclock")
    (site / "myplugins" / "probe.py").write_text(PROBE)
    log = tmp_path / "probe.log"
    proc = run(
        tmp_path,
        {
            "ENGINE_PLUGINS": f"{module},myplugins.probe,skipdetok",
            "PYTHONPATH": str(site),
            "PROBE_LOG": str(log),
        },
        WRAPPER_SCRIPT,
    )
    out = result(proc)
    pids = out["pids"]
    role_of = {pids[r]: r for r in ("user", "scheduler", "detokenizer")}
    lines = [line.split() for line in log.read_text().splitlines()]
    # only the engine's three processes (before the fix: multiprocessing's resource tracker too)
    assert {int(pid) for _, pid, _ in lines} == set(role_of), lines
    for (
        what,
        pid,
        role,
    ) in lines:  # the true role, from the plugin's import on (before: "user" in the children)
        assert role == role_of[int(pid)], (what, pid, role)
    assert sorted(what for what, _, _ in lines) == ["import"] * 3 + ["logit_processors"] * 3
    # the wrappers ran: the detokenizer's rewrote skipdetok's empty texts, the user's marked the result
    assert out["text"] == "".join(f"<{t}>" for t in out["ids"]) and len(out["ids"]) == 6
    assert out["meta"]["wrapped_in"] == "user"
    stats = out["stats"]
    assert stats["scheduler"][module]["wrapped"] == 6  # one prefill and five decode steps
    assert stats["scheduler"][module]["seconds"] >= 0.0
    assert stats["detokenizer"][module]["wrapped"] >= 6
    assert stats["user"][module]["wrapped"] == 1

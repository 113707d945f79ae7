"""Installs ENGINE_PLUGINS in the engine's scheduler and detokenizer at interpreter start, then runs
the next sitecustomize on the path (a user's own keeps working).

The engine puts this folder first on its children's PYTHONPATH when ENGINE_PLUGINS is set, and
ENGINE_PROCESS_ROLE names the child's role. Plugins load only in a process that is one of the
engine's children, a multiprocessing spawn child with that role set, never in another interpreter
that happens to inherit the environment (multiprocessing's resource tracker, a tool the user
starts). The role is set before the first plugin is imported, so `current_role()` is right from a
plugin's first line. A plugin that cannot be imported yet (a module next to the user's script: a
spawned child gets the parent's sys.path only after start-up) is left to the child's own strict
pass, which reports errors properly, and so are the plugins after it in ENGINE_PLUGINS: every
process registers them in the same order, so pluggy calls them alike.
"""

import os
import sys


def _engine_child_role() -> str | None:
    role = os.environ.get("ENGINE_PROCESS_ROLE")
    if role not in ("scheduler", "detokenizer"):
        return None
    argv = getattr(sys, "orig_argv", None) or sys.argv
    return role if "--multiprocessing-fork" in argv else None


def _install(role: str) -> None:
    try:
        from engine.hooks import set_role
        from engine.hooks.loader import install_from_env

        set_role(role)
        install_from_env(strict=False)
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up; the child reports it
        import logging  # here only: interpreter start-up imports nothing it does not need

        # named, not __name__: this file runs as the top-level module `sitecustomize`
        logging.getLogger("engine.sitecustomize").warning(
            "engine sitecustomize: plugins not installed at start-up: %s: %s",
            type(exc).__name__,
            exc,
        )


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if (
        spec is None
        or spec.loader is None
        or os.path.abspath(spec.origin or "") == os.path.abspath(__file__)
    ):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_role = _engine_child_role()
if _role is not None and os.environ.get("ENGINE_PLUGINS"):
    _install(_role)
_chain()

"""Installs ENGINE_PLUGINS in a process of the engine at interpreter start, then runs the next
sitecustomize on the path (a user's own keeps working).

The engine puts this folder first on its children's PYTHONPATH when ENGINE_PLUGINS is set, so the
environment variable is all a user sets. Without ENGINE_PLUGINS it only chains. A plugin that cannot
be imported yet (a module next to the user's script: a spawned child gets the parent's sys.path only
after start-up) is left to the child's own strict pass, which reports errors properly.
"""

import os
import sys


def _install() -> None:
    try:
        from engine.hooks.loader import install_from_env

        install_from_env(strict=False)
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up; the child reports it
        print(f"engine sitecustomize: plugins not installed at start-up: {type(exc).__name__}: {exc}", file=sys.stderr)


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("ENGINE_PLUGINS"):
    _install()
_chain()

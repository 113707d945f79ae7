"""The process's plugin manager and the calls the engine makes into it.

Why not `pm.hook.<name>(...)` directly: each implementation is called here one by one, so an
exception names the plugin and the hook it came from, and a hook nobody implements costs one dict
lookup at its call site (`has(name)` guards the call sites on the hot path).
"""

from __future__ import annotations

import os

import pluggy

PROJECT = "engine"
hookimpl = pluggy.HookimplMarker(PROJECT)

_pm: pluggy.PluginManager | None = None
_impls: dict[str, tuple] = {}  # hook name -> ((plugin name, function, argument names), ...) in call order
_role = "user"


class HookError(Exception):
    """A plugin's hook raised; the requests it was called for fail with this message."""

    def __init__(self, plugin: str, hook: str, exc: BaseException) -> None:
        super().__init__(f"plugin {plugin!r} failed in hook {hook}: {type(exc).__name__}: {exc}")
        self.plugin, self.hook, self.original = plugin, hook, exc


class FatalHookError(BaseException):
    """ENGINE_PLUGIN_ERRORS=raise: a plugin error stops the process (not caught by request isolation)."""


class PluginLoadError(ValueError):
    """ENGINE_PLUGINS names a plugin that cannot be loaded."""


def plugin_manager() -> pluggy.PluginManager:
    global _pm
    if _pm is None:
        from engine.hooks.specs import EngineSpecs

        _pm = pluggy.PluginManager(PROJECT)
        _pm.add_hookspecs(EngineSpecs)
    return _pm


def refresh() -> None:
    """Rebuild the call lists after plugins were registered or unregistered."""
    pm = plugin_manager()
    _impls.clear()
    for name in dir(pm.hook):
        if not name.startswith("engine_"):
            continue
        impls = getattr(pm.hook, name).get_hookimpls()
        if impls:  # pluggy calls the last registered first; keep its order
            _impls[name] = tuple((i.plugin_name, i.function, i.argnames) for i in reversed(impls))


def has(name: str) -> bool:
    return name in _impls


def implementers(name: str) -> list[str]:
    """The plugins implementing a hook, in call order."""
    return [plugin for plugin, _, _ in _impls.get(name, ())]


def _fatal() -> bool:
    return os.environ.get("ENGINE_PLUGIN_ERRORS", "") == "raise"


def _run(name: str, plugin: str, fn, argnames, kwargs: dict):
    try:
        return fn(**{a: kwargs[a] for a in argnames})
    except Exception as exc:
        if _fatal():
            raise FatalHookError(str(HookError(plugin, name, exc))) from exc
        raise HookError(plugin, name, exc) from exc


def call(name: str, **kwargs) -> list:
    """Call every implementation; their non-None results, in call order. Raises HookError."""
    out = []
    for plugin, fn, argnames in _impls.get(name, ()):
        result = _run(name, plugin, fn, argnames, kwargs)
        if result is not None:
            out.append(result)
    return out


def call_named(name: str, **kwargs) -> dict:
    """Like call, keyed by plugin name."""
    out = {}
    for plugin, fn, argnames in _impls.get(name, ()):
        result = _run(name, plugin, fn, argnames, kwargs)
        if result is not None:
            out[plugin] = result
    return out


def call_first(name: str, **kwargs):
    """The first non-None result (pluggy's firstresult), or None."""
    for plugin, fn, argnames in _impls.get(name, ()):
        result = _run(name, plugin, fn, argnames, kwargs)
        if result is not None:
            return result
    return None


def set_role(role: str) -> None:
    global _role
    _role = role


def current_role() -> str:
    """"user", "scheduler" or "detokenizer": the engine process this code runs in."""
    return _role

"""ENGINE_PLUGINS=a,b,pkg.module:obj -> plugins registered in this process.

A bare name is an entry point of the group `engine.plugins`; anything with a dot or a colon is
imported (`pkg.module` registers the module, `pkg.module:obj` the object; a class is instantiated).
Loading is idempotent per process: a name loaded before is skipped, and so is a name for what another
name loaded (`metrics` and `engine.plugins.metrics`: one plugin, registered once).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from engine import envvars
from engine.hooks.runtime import PluginLoadError, registry_lock, plugin_manager, refresh, register

ENTRY_POINT_GROUP = "engine.plugins"
ENV = "ENGINE_PLUGINS"
_loaded: dict[str, object] = {}
_targets: dict[
    str, object
] = {}  # name -> what it names (a module, a class, an object), to spot two names for one


def available_plugins() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def parse_spec(spec: str | None) -> list[str]:
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def _resolve(name: str) -> object:
    """What the name names: a module, a class (instantiated by _instantiate) or an object."""
    if ":" in name or "." in name:
        module, _, attr = name.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split(".") if attr else []:
                obj = getattr(obj, part)
        except (
            Exception
        ) as exc:  # not found, or its import raised (a SyntaxError, its own error): name it
            raise PluginLoadError(
                f"plugin {name!r} cannot be imported: {type(exc).__name__}: {exc}"
            ) from exc
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise PluginLoadError(
                f"unknown plugin {name!r} in {ENV}; available plugins: {', '.join(available_plugins()) or 'none'} "
                "(or give a dotted path, pkg.module:object)"
            )
        try:
            obj = found[0].load()
        except Exception as exc:  # its module or a dependency is missing or broken: name the plugin
            raise PluginLoadError(
                f"plugin {name!r} cannot be imported: {type(exc).__name__}: {exc}"
            ) from exc
    return obj


def _instantiate(name: str, target: object) -> object:
    if not isinstance(target, type):
        return target
    try:
        return target()
    except Exception as exc:
        raise PluginLoadError(
            f"plugin {name!r} cannot be created: {type(exc).__name__}: {exc}"
        ) from exc


def load_plugins(spec: str | None, strict: bool = True) -> list[str]:
    """Register the plugins named in spec. strict=False skips those that cannot load yet (the
    sitecustomize pass, before a child's sys.path is set up); the child's own pass is strict."""
    names = parse_spec(spec)
    with registry_lock:  # two engines started from two threads load one at a time
        for name in names:
            if not _load_one(name, strict):
                break  # the strict pass loads it and the ones after it, in order: every process calls them alike
        refresh()
    return names


def _load_one(name: str, strict: bool) -> bool:
    """Register one plugin; False when it cannot load yet (strict=False)."""
    if name in _loaded:
        return True
    try:
        target = _resolve(name)
        same = next((other for other, t in _targets.items() if t is target), None)
        if same is not None:  # another name for a plugin loaded already
            _loaded[name], _targets[name] = _loaded[same], target
            return True
        obj = _instantiate(name, target)
    except PluginLoadError:
        if strict:
            raise
        return False
    register(obj, name)  # refuses a wrapper that cannot run as marked, or a hook no spec names
    provide = getattr(obj, "engine_logit_processors", None)
    if provide is not None:
        from engine.sampling.processors import register_logit_processor

        try:
            for proc_name, cls in (provide() or {}).items():
                register_logit_processor(proc_name, cls)
        except BaseException as exc:  # not left half loaded, whatever it raised
            plugin_manager().unregister(obj)
            refresh()
            if not isinstance(exc, Exception):
                raise
            raise PluginLoadError(
                f"plugin {name!r} failed in engine_logit_processors: {type(exc).__name__}: {exc}"
            ) from exc
    _loaded[name], _targets[name] = obj, target
    return True


def install_from_env(strict: bool = True) -> list[str]:
    return load_plugins(envvars.read(ENV), strict)


def loaded_plugins() -> list[str]:
    return list(_loaded)


def unload_plugins(names: list[str]) -> None:
    """Unregister plugins from this process (tests, notebooks). Logit processors they registered stay."""
    pm = plugin_manager()
    with registry_lock:
        for name in names:
            obj = _loaded.pop(name, None)
            _targets.pop(name, None)
            if (
                obj is not None
                and not any(other is obj for other in _loaded.values())
                and pm.is_registered(obj)
            ):
                pm.unregister(obj)
        refresh()

"""ENGINE_PLUGINS=a,b,pkg.module:obj -> plugins registered in this process.

A bare name is an entry point of the group `engine.plugins`; anything with a dot or a colon is
imported (`pkg.module` registers the module, `pkg.module:obj` the object; a class is instantiated).
Loading is idempotent per process: a name loaded before is skipped.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from engine import envvars
from engine.hooks.runtime import PluginLoadError, registry_lock, plugin_manager, refresh, register

ENTRY_POINT_GROUP = "engine.plugins"
ENV = "ENGINE_PLUGINS"
_loaded: dict[str, object] = {}


def available_plugins() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def parse_spec(spec: str | None) -> list[str]:
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def _resolve(name: str) -> object:
    if ":" in name or "." in name:
        module, _, attr = name.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split(".") if attr else []:
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise PluginLoadError(f"plugin {name!r} cannot be imported: {type(exc).__name__}: {exc}") from exc
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
            raise PluginLoadError(f"plugin {name!r} cannot be imported: {type(exc).__name__}: {exc}") from exc
    return obj() if isinstance(obj, type) else obj


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
        obj = _resolve(name)
    except PluginLoadError:
        if strict:
            raise
        return False
    register(obj, name)  # refuses a wrapper that cannot run as marked
    provide = getattr(obj, "engine_logit_processors", None)
    if provide is not None:
        from engine.sampling.processors import register_logit_processor

        try:
            for proc_name, cls in (provide() or {}).items():
                register_logit_processor(proc_name, cls)
        except Exception as exc:  # not left half loaded
            plugin_manager().unregister(obj)
            refresh()
            raise PluginLoadError(f"plugin {name!r} failed in engine_logit_processors: {type(exc).__name__}: {exc}") from exc
    _loaded[name] = obj
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
            if obj is not None:
                pm.unregister(obj)
        refresh()

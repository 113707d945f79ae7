"""The process's plugin manager and the calls the engine makes into it.

Calls go through pluggy's own hook caller, so everything a pluggy user expects holds: call order,
tryfirst/trylast, firstresult, and wrappers (`@hookimpl(wrapper=True)` and the old
`hookwrapper=True`) around the plain implementations. What the engine adds: every implementation's
function is isolated at registration, so an exception leaves it as a HookError naming the plugin
and the hook (the requests concerned fail, the process serves on), and a hook nobody implements
costs one dict lookup at its call site (`has(name)` guards the hot path).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable

import pluggy

from engine import envvars

logger = logging.getLogger(__name__)
PROJECT = "engine"
hookimpl = pluggy.HookimplMarker(PROJECT)

# Hooks whose results are gathered per plugin (keyed by plugin name): a wrapper around them would
# have no single result to see, so one is refused at load time rather than silently skipped.
PER_PLUGIN_HOOKS = (
    "engine_stats",
    "engine_logit_processors",
    "engine_layer_taps",
    "engine_steering_vectors",
)
# Hooks that report what already happened: nothing is left to fail, so a plain implementation's error
# is logged where it happens and the plugins after it still get the event (pluggy would stop at it).
AFTER_THE_FACT_HOOKS = (
    "engine_request_done",
    "engine_request_finished",
    "engine_step_end",
    "engine_detokenize_output",
    "engine_process_stop",
    "engine_shutdown_report",
)

_pm: pluggy.PluginManager | None = None
_callers: dict[str, Any] = {}  # hook name -> pluggy HookCaller, only for hooks with implementations
# loading, unloading and rebuilding the table; calls never take it
registry_lock = threading.RLock()
_ROLES = ("user", "scheduler", "detokenizer")


def _initial_role() -> str:
    """A child knows its role from interpreter start: the engine sets ENGINE_PROCESS_ROLE for it."""
    role = envvars.read("ENGINE_PROCESS_ROLE")
    return role if role in _ROLES else "user"


_role = _initial_role()


class HookError(Exception):
    """A plugin's hook raised; the requests it was called for fail with this message."""

    def __init__(self, plugin: str, hook: str, exc: BaseException) -> None:
        super().__init__(f"plugin {plugin!r} failed in hook {hook}: {type(exc).__name__}: {exc}")
        self.plugin, self.hook, self.original = plugin, hook, exc


class FatalHookError(BaseException):
    """ENGINE_PLUGIN_ERRORS=raise: a plugin error stops the process (not caught by request isolation)."""


class PluginLoadError(ValueError):
    """ENGINE_PLUGINS names a plugin that cannot be loaded."""


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, whose register and unregister keep the engine's table right (isolated
    implementations, has()) whoever calls them: the loader, or code holding plugin_manager()."""

    def register(self, plugin: object, name: str | None = None) -> str | None:
        with registry_lock:
            result = super().register(plugin, name)
            try:
                try:
                    self.check_pending()  # a hook no spec names: a misspelt one would never be called
                except pluggy.PluginValidationError as exc:
                    raise PluginLoadError(
                        f"plugin {name or plugin!r} implements a hook the engine does not have: {exc}"
                    ) from exc
                _check(self)
            except PluginLoadError:
                super().unregister(plugin)
                refresh()
                raise
            refresh()
            return result

    def unregister(self, plugin: object | None = None, name: str | None = None) -> object | None:
        with registry_lock:
            result = super().unregister(plugin, name)
            refresh()
            return result


def plugin_manager() -> pluggy.PluginManager:
    global _pm
    with registry_lock:
        if _pm is None:
            from engine.hooks.specs import EngineSpecs

            _pm = _PluginManager(PROJECT)
            _pm.add_hookspecs(EngineSpecs)
        return _pm


def _passes(exc: BaseException) -> bool:
    """What request isolation must not catch: the project's fatal error, and Ctrl-C in the user
    process's main thread (the caller stops). Ctrl-C reaches no other thread (the async submit worker,
    a server's threads) and the children ignore SIGINT, so a KeyboardInterrupt there is a plugin's own
    raise, isolated like SystemExit and every other BaseException."""
    return isinstance(exc, FatalHookError) or (
        isinstance(exc, KeyboardInterrupt)
        and _role == "user"
        and threading.current_thread() is threading.main_thread()
    )


def _named(plugin: str, hook: str, exc: BaseException) -> BaseException:
    if isinstance(exc, HookError) or _passes(exc):
        return exc  # already named, by the implementation it came from; or not ours to catch
    if envvars.read("ENGINE_PLUGIN_ERRORS") == "raise":
        return FatalHookError(str(HookError(plugin, hook, exc)))
    return HookError(plugin, hook, exc)


def _isolate_plain(plugin: str, hook: str, fn: Callable) -> Callable:
    after_the_fact = hook in AFTER_THE_FACT_HOOKS

    def isolated(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit too: a plugin must not stop the process
            named = _named(plugin, hook, exc)
            if named is exc:
                raise
            if after_the_fact and isinstance(named, HookError):
                prefix = "engine" if _role == "user" else f"engine::{_role}"
                logger.error("%s: %s", prefix, named)
                return None
            raise named from exc

    return isolated


def _isolate_wrapper(plugin: str, hook: str, fn: Callable) -> Callable:
    """A generator standing in for the plugin's wrapper: forwards what pluggy sends or throws, and
    names the plugin when the wrapper's own code raises (an error thrown in from an inner
    implementation, already named, passes through unchanged)."""

    def misbehaved(what: str) -> BaseException:
        return _named(
            plugin, hook, RuntimeError(f"a hook wrapper must yield exactly once; it {what}")
        )

    def name(exc: BaseException) -> BaseException:
        named = _named(plugin, hook, exc)
        if named is not exc:
            named.__cause__ = exc
        return named

    def isolated(*args, **kwargs):
        try:
            gen = fn(*args, **kwargs)
            next(gen)
        except StopIteration:
            raise misbehaved("returned without yielding") from None
        except BaseException as exc:  # SystemExit too: a plugin must not stop the process
            raise name(exc)
        try:
            try:
                sent = yield
            except BaseException as thrown:  # an inner implementation (or wrapper) raised
                try:
                    gen.throw(thrown)
                except StopIteration as stop:
                    return stop.value
                except BaseException as exc:
                    if exc is thrown:
                        raise
                    raise name(exc)
            else:
                try:
                    gen.send(sent)
                except StopIteration as stop:
                    return stop.value
                except BaseException as exc:
                    raise name(exc)
            raise misbehaved("yielded twice")
        finally:
            gen.close()

    return isolated


def _isolate(hook: str, impl) -> None:
    """Replace an implementation's function by its isolated form, once (refresh runs often)."""
    fn = impl.function
    if getattr(fn, "__engine_isolated__", False):
        return
    wrapper = impl.wrapper or impl.hookwrapper
    if wrapper and hook in PER_PLUGIN_HOOKS:
        raise PluginLoadError(
            f"plugin {impl.plugin_name!r}: {hook} gathers one result per plugin, so it cannot be wrapped; "
            "implement it as a plain hook"
        )
    if wrapper and not inspect.isgeneratorfunction(inspect.unwrap(fn)):
        raise PluginLoadError(
            f"plugin {impl.plugin_name!r}: its {hook} is marked as a hook wrapper but is not a generator "
            "function (a wrapper yields once, around the other implementations)"
        )
    isolated = (_isolate_wrapper if wrapper else _isolate_plain)(impl.plugin_name, hook, fn)
    isolated.__engine_isolated__ = True
    isolated.__wrapped__ = fn
    impl.function = isolated  # pluggy keeps argnames from the original; it calls function(*args)


def _check(pm: pluggy.PluginManager) -> dict[str, Any]:
    """Isolate every implementation; raise PluginLoadError for one that cannot run as marked."""
    callers = {}
    for name in dir(pm.hook):
        if not name.startswith("engine_"):
            continue
        caller = getattr(pm.hook, name)
        impls = caller.get_hookimpls()
        for impl in impls:
            _isolate(name, impl)
        if impls:
            callers[name] = caller
    return callers


def refresh() -> None:
    """Rebuild the table of implemented hooks after plugins were registered or unregistered. The
    new table replaces the old one in one assignment: a hook call running in another thread keeps
    the table it started with."""
    global _callers
    with registry_lock:
        _callers = _check(plugin_manager())


def register(obj: object, name: str) -> None:
    """Register a plugin, checked: a wrapper that cannot run as marked is refused, and the plugin
    is not left half registered."""
    try:
        plugin_manager().register(obj, name=name)
    except PluginLoadError:
        raise
    except Exception as exc:  # pluggy: the same object under two names, or a bad hook signature
        raise PluginLoadError(f"plugin {name!r} cannot be registered: {exc}") from exc


def has(name: str) -> bool:
    return name in _callers


def implementers(name: str) -> list[str]:
    """The plugins implementing a hook, in call order: wrappers (outermost first), then the plain ones."""
    caller = _callers.get(name)
    return [impl.plugin_name for impl in reversed(caller.get_hookimpls())] if caller else []


def call(name: str, **kwargs) -> list:
    """Call the hook the pluggy way; the non-None results, in call order. Raises HookError."""
    caller = _callers.get(name)
    return caller(**kwargs) if caller is not None else []


def call_first(name: str, **kwargs):
    """A firstresult hook: the first non-None result, or None."""
    caller = _callers.get(name)
    return caller(**kwargs) if caller is not None else None


def call_each(name: str, **kwargs) -> list[tuple[str, Any, HookError | None]]:
    """A per-plugin hook (PER_PLUGIN_HOOKS): (plugin name, result, error) for each implementation, in
    call order; a plugin that failed has result None and its HookError (a fatal error still raises)."""
    caller = _callers.get(name)
    out = []
    for impl in reversed(caller.get_hookimpls()) if caller is not None else ():
        try:
            out.append((impl.plugin_name, impl.function(*(kwargs[a] for a in impl.argnames)), None))
        except HookError as exc:
            out.append((impl.plugin_name, None, exc))
    return out


def call_named(name: str, **kwargs) -> dict:
    """A per-plugin hook's non-None results by plugin name. A plugin that fails gives {"error":
    message} in its place: one broken plugin must not hide the others' figures, nor break
    get_stats() and the shutdown report."""
    out = {}
    for plugin, result, error in call_each(name, **kwargs):
        if error is not None:
            result = {"error": str(error)}
        if result is not None:
            out[plugin] = result
    return out


def set_role(role: str) -> None:
    global _role
    _role = role


def current_role() -> str:
    """ "user", "scheduler" or "detokenizer": the engine process this code runs in, right from the
    moment a plugin is imported (children learn it at interpreter start)."""
    return _role

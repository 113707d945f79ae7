"""Pluggy hooks on every stage of inference, in whichever process the stage runs.

    from engine.hooks import hookimpl

    class MyPlugin:
        @hookimpl
        def engine_forward_after(self, batch, rids, logits): ...

docs/plugins.md has the table of hooks; engine/hooks/specs.py is the specification itself.
"""

from engine.hooks.runtime import (
    HookError,
    PluginLoadError,
    FatalHookError,
    call,
    call_each,
    call_first,
    call_named,
    current_role,
    has,
    hookimpl,
    implementers,
    plugin_manager,
    set_role,
)

__all__ = [
    "FatalHookError",
    "HookError",
    "PluginLoadError",
    "call",
    "call_each",
    "call_first",
    "call_named",
    "current_role",
    "has",
    "hookimpl",
    "implementers",
    "plugin_manager",
    "set_role",
]

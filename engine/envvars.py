"""Every ENGINE_* environment variable, read here and nowhere else.

One registry so that the docs' table (docs/configuration.md, also printed by `engine env`) and the
code cannot drift apart: each variable has its meaning and its default next to the one function
that reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # the value when unset ("" = unset means off / none)
    values: str  # what it accepts
    meaning: str
    secret: bool = False  # never printed (engine env shows only that it is set)


VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "ENGINE_PLUGINS",
            "",
            "a,b,pkg.module:obj",
            "plugins loaded in all three engine processes (entry points of group engine.plugins, or import paths)",
        ),
        EnvVar(
            "ENGINE_PLUGIN_ERRORS",
            "",
            "raise",
            "raise: a plugin error stops the process (development); otherwise it fails only the requests concerned",
        ),
        EnvVar(
            "ENGINE_TRACING",
            "0",
            "1 or 0",
            "1: the tracing plugin in all three processes (OpenTelemetry spans)",
        ),
        EnvVar(
            "ENGINE_TRACE_FILE",
            "",
            "a file path",
            "also write every span as OTLP/JSON lines to this file",
        ),
        EnvVar(
            "ENGINE_TRACE_STEPS",
            "1",
            "N >= 0",
            "keep one scheduler-step trace in N (0: none; failed steps always)",
        ),
        EnvVar(
            "ENGINE_CACHE_DIR",
            "",
            "a directory",
            "where the dequantized embedded model, the compiled C kernels, int8 weights and float32 "
            "panels are cached (default: the user cache dir); its folders named "
            "`<name>-<16 hex digits>` with a `.complete` mark are the engine's conversions, "
            "which a new conversion may remove",
        ),
        EnvVar(
            "ENGINE_NATIVE_KERNELS",
            "1",
            "1 or 0",
            "0: never build or load the C kernels (torch attention only; quantization=int8 and gguf refused)",
        ),
        EnvVar(
            "ENGINE_PYSPY",
            "",
            "a file path",
            "the py-spy binary engine profile and engine dump use",
        ),
        EnvVar(
            "ENGINE_METRICS_PORT",
            "",
            "a TCP port",
            "with the metrics plugin: an offline Engine serves Prometheus metrics on 127.0.0.1 at this port",
        ),
        EnvVar(
            "ENGINE_API_KEY",
            "",
            "a secret",
            "engine serve: the API key clients must send (safer than --api-key, which other users see in ps)",
            secret=True,
        ),
        EnvVar(
            "ENGINE_PROCESS_ROLE",
            "",
            "scheduler or detokenizer",
            "set by the engine for its children only, so plugins know their role from interpreter start; never set it",
        ),
        EnvVar(
            "ENGINE_CAPTURE_DIR",
            "activations",
            "a directory",
            "capture_activations plugin: where its safetensors shards go",
        ),
        EnvVar(
            "ENGINE_CAPTURE_LAYERS",
            "-1",
            "comma-separated layer indices",
            "capture_activations plugin: the layers it captures",
        ),
        EnvVar(
            "ENGINE_CAPTURE_POINT",
            "resid_post",
            "resid_post, attn_out or mlp_out",
            "capture_activations plugin: the point it captures",
        ),
        EnvVar(
            "ENGINE_CAPTURE_SHARD_ROWS",
            "65536",
            "N >= 1",
            "capture_activations plugin: rows per shard",
        ),
        EnvVar(
            "ENGINE_CAPTURE_EVERY_REQUEST",
            "0",
            "1 or 0",
            'capture_activations plugin: 1 captures every request; else those with layer_taps=["capture"]',
        ),
        EnvVar(
            "ENGINE_LOGIT_LENS_LAYERS",
            "",
            "comma-separated layer indices",
            "logit_lens plugin: the layers it reads (unset: every layer)",
        ),
        EnvVar(
            "ENGINE_LOGIT_LENS_TOP_K",
            "5",
            "N >= 1",
            "logit_lens plugin: tokens kept per layer and position",
        ),
        EnvVar(
            "ENGINE_LOGIT_LENS_FILE",
            "",
            "a file path",
            "logit_lens plugin: also append each finished request's record as a JSON line",
        ),
        EnvVar(
            "ENGINE_STEER_VECTORS",
            "",
            "comma-separated file paths",
            "steer_contrast plugin: vector files made by make_vector, registered by name",
        ),
    )
}


def read(name: str) -> str:
    """The variable's value, or its default; stripped. Unknown names are a programming error."""
    var = VARIABLES[name]
    return os.environ.get(name, var.default).strip()


# the switches' accepted values (or unset, or empty)
SWITCH_VALUES = {
    "1 or 0": ("1", "0"),
    "raise": ("raise",),
}


# the per-kernel A/B switches, now rows of engine/linear/choose.py's table: (old default, override)
RETIRED = {
    "ENGINE_PACK_WEIGHTS": ("1", "torch-plain=on"),
    "ENGINE_BF16_LINEAR": ("1", "bf16-kernel=off"),
    "ENGINE_F32_LINEAR": ("1", "f32-panels=off,f32-blocks=off"),
    "ENGINE_EXACT_BLOCKS": ("1", "f32-blocks=off"),
    "ENGINE_PANEL_CACHE": ("0", "f32-panels-cached=on"),
    "ENGINE_FUSED_DECODE": ("1", "fused-decode=off"),
    "ENGINE_DECODE_LAYERS": ("1", "decode-layers-c=off"),
    "ENGINE_NATIVE_EXTEND": ("1", "native-extend=off"),
}


def check_switches() -> None:
    """Raise ValueError naming a switch set to a value it does not take: `ENGINE_NATIVE_KERNELS=no`
    read as "not 0" would leave the kernels on without a word. The other variables are checked where
    they are read (ENGINE_TRACING, ENGINE_TRACE_STEPS, ENGINE_TRACE_FILE, ENGINE_METRICS_PORT)."""
    for name, (default, override) in RETIRED.items():
        value = os.environ.get(name, "").strip()
        if value and value != default:
            raise ValueError(
                f"{name} is retired: use kernel_overrides (engine serve --kernel-overrides "
                f"{override}; docs/configuration.md)"
            )
    for var in VARIABLES.values():
        allowed = SWITCH_VALUES.get(var.values)
        value = os.environ.get(var.name, "").strip()
        if allowed is not None and value and value not in allowed:
            raise ValueError(
                f"{var.name}={value!r} is not supported: only {' and '.join(allowed)} (or unset)"
            )


def table() -> str:
    """The variables as a Markdown table (docs/configuration.md holds the same)."""
    rows = ["| variable | values | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        rows.append(
            f"| `{v.name}` | {v.values} | {('`' + v.default + '`') if v.default else 'unset'} | {v.meaning} |"
        )
    return "\n".join(rows)

"""The `engine` command: profile and dump (py-spy, engine/profiling), trace (OpenTelemetry,
engine/tracing), env (the ENGINE_* variables, engine/envvars.py), info (the kernel choices)."""

from __future__ import annotations

import sys

USAGE = """usage: engine {serve,profile,dump,trace,env,info} ...

  engine serve [options]                    an OpenAI-compatible HTTP server (docs/server.md)
  engine profile [options] -- command ...   py-spy in every engine process (docs/profiling.md)
  engine dump [--pid PID]                   stacks of every process of the running engines
  engine trace {receive,list,perfetto,timeline} ...   spans without a Jaeger (docs/tracing.md)
  engine env                                the ENGINE_* variables: meaning, default, value here
  engine info [--quantization Q] [--dtype D] [--model-path P] [--override ROW=off|on]
                                            the kernel each linear layer gets here, and why
"""


def _env() -> int:
    import os

    from engine.envvars import VARIABLES, table

    print(table())
    here = [
        f"{name}=<set>" if VARIABLES[name].secret else f"{name}={os.environ[name]}"
        for name in VARIABLES
        if name in os.environ
    ]
    print("\nset here: " + (", ".join(here) if here else "none"))
    return 0


def _info(argv: list[str]) -> int:
    """Load the model in this process (no engine processes) and print the choice table's picks."""
    import argparse

    from engine.config import EngineConfig

    parser = argparse.ArgumentParser(prog="engine info", description=_info.__doc__)
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--override", action="append", default=[], metavar="ROW=off|on", help="kernel_overrides"
    )
    args = parser.parse_args(argv)
    overrides = dict(o.split("=", 1) if "=" in o else (o, "") for o in args.override)
    config = EngineConfig(
        model_path=args.model_path,
        quantization=args.quantization,
        dtype=args.dtype,
        device=args.device,
        kernel_overrides=overrides,
    )
    try:
        config.validate()
    except ValueError as e:
        print(f"engine info: {e}", file=sys.stderr)
        return 2
    import torch

    from engine.linear.choose import table
    from engine.model.config import load_hf_config
    from engine.model.loader import kernel_info, load_model
    from engine.model.resolve import resolve_model_dir
    from engine.quantization import check_quantization, resolve_device_for, resolve_dtype_for
    from engine.scheduler.device import resolve_device, resolve_dtype

    model_dir = resolve_model_dir(config.model_path, announce=None)
    device = resolve_device(resolve_device_for(config.quantization, config.device))
    dtype = resolve_dtype(resolve_dtype_for(config.quantization, config.dtype), device)
    check_quantization(config.quantization, device, dtype)
    hf_config = load_hf_config(model_dir)
    model, _ = load_model(
        model_dir, hf_config, dtype, device, 64, None, config.quantization, overrides
    )
    info = kernel_info(model)
    cpu = torch.backends.cpu.get_cpu_capability() if device == "cpu" else device
    print(f"model: {model_dir}")
    print(
        f"quantization={config.quantization} dtype={str(dtype).removeprefix('torch.')} "
        f"device={device} ({cpu})"
    )
    print("linear layers (layer: table row: reason):")
    for kind, why in info["linear_choices"].items():
        print(f"  {kind:<13} {why}")
    print(f"classes: {', '.join(info['linear_layers'])}")
    print(f"decode path: {info['decode_path']}")
    print("\nthe table, first row that holds (EngineConfig.kernel_overrides={row: 'off'|'on'}):")
    print(table())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "trace":
        from engine.tracing.cli import main as trace_main

        return trace_main(argv[1:])
    if argv and argv[0] == "serve":
        from engine.serve.cli import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "env":
        if argv[1:] in (["-h"], ["--help"]):
            print(USAGE)
            return 0
        if len(argv) > 1:
            print(
                f"engine env takes no arguments, got {' '.join(argv[1:])!r}\n\n{USAGE}",
                file=sys.stderr,
            )
            return 2
        return _env()
    if argv and argv[0] == "info":
        return _info(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in ("profile", "dump"):  # else the profiling parser's error lists only its two
        print(f"engine: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from engine.profiling.cli import main as profiling_main

    return profiling_main(argv)


if __name__ == "__main__":
    sys.exit(main())

"""The `engine` command: profile and dump (py-spy, engine/profiling), trace (OpenTelemetry,
engine/tracing), env (the ENGINE_* variables, engine/envvars.py)."""

from __future__ import annotations

import sys

USAGE = """usage: engine {serve,profile,dump,trace,env} ...

  engine serve [options]                    an OpenAI-compatible HTTP server (docs/server.md)
  engine profile [options] -- command ...   py-spy in every engine process (docs/profiling.md)
  engine dump [--pid PID]                   stacks of every process of the running engines
  engine trace {receive,list,perfetto,timeline} ...   spans without a Jaeger (docs/tracing.md)
  engine env                                the ENGINE_* variables: meaning, default, value here
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

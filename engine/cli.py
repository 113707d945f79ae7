"""The `engine` command: profile and dump (py-spy, engine/profiling), trace (OpenTelemetry, engine/tracing)."""

from __future__ import annotations

import sys

USAGE = """usage: engine {profile,dump,trace} ...

  engine profile [options] -- command ...   py-spy in every engine process (docs/profiling.md)
  engine dump [--pid PID]                   stacks of every process of the running engines
  engine trace {receive,list,perfetto,timeline} ...   spans without a Jaeger (docs/tracing.md)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "trace":
        from engine.tracing.cli import main as trace_main

        return trace_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    from engine.profiling.cli import main as profiling_main

    return profiling_main(argv)


if __name__ == "__main__":
    sys.exit(main())

"""engine serve [options]: start the engine, then serve it over HTTP until SIGTERM or Ctrl-C.

Every Engine option is a flag, made from EngineConfig's fields (not listed twice). With --dp N > 1
it starts N such servers behind the SGLang model gateway instead (engine/serve/replicas.py). Exit
codes: 0 after a regular stop (in-flight requests finished or, past --shutdown-timeout, aborted;
traces flushed; no process left), 1 when the engine could not start or one of its processes died
while serving (so a supervisor restarts the server), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from engine import envvars
from engine.config import EngineConfig
from engine.serve.gateway import POLICIES

DEFAULT_PORT = 30000


# SGLang's name for a field where it differs from the field's own flag
FLAG_ALIASES = {"tp_size": ("--tp",)}


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (the fields of EngineConfig, docs/api.md)")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if kind.startswith("dict"):
            group.add_argument(
                flag, dest=f.name, type=_pairs, default=default, help="ROW=VALUE,... (default none)"
            )
            continue
        if kind.startswith("bool"):
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help="(default %(default)s)",
            )
            continue
        convert = int if kind.startswith("int") else float if kind.startswith("float") else str
        group.add_argument(
            flag,
            *FLAG_ALIASES.get(f.name, ()),
            dest=f.name,
            type=convert,
            default=default,
            help="(default %(default)s)",
        )


def _pairs(text: str) -> dict[str, str]:
    """argparse's type for `a=b,c=d` (EngineConfig checks the names and values)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not all("=" in item for item in items):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE[,NAME=VALUE...], got {text!r}")
    return dict(tuple(part.strip() for part in item.split("=", 1)) for item in items)


def _number(text: str, kind: type, ok, what: str):
    """argparse's type for a number in a range: refused at parsing (exit 2, naming the flag), not once
    the engine has started."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"give {what}, got {text!r}")
    return value


def _port(text: str) -> int:
    return _number(text, int, lambda v: 0 <= v <= 65535, "a TCP port, 0-65535 (0: any free one)")


def _seconds(text: str) -> float:
    # NaN fails too
    return _number(text, float, lambda v: v >= 0, "seconds >= 0 (inf: wait for every request)")


def _positive(text: str) -> int:
    return _number(text, int, lambda v: v > 0, "a whole number > 0")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine serve", description="the engine behind an OpenAI-compatible HTTP API"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)"
    )
    p.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--api-key", default=None, help="clients must send it as a Bearer token (or ENGINE_API_KEY)"
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model name in the API (default: the model's)"
    )
    p.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=1 << 20,
        help="largest request body (default 1 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM or Ctrl-C (default 30)",
    )
    p.add_argument(
        "--open-metrics",
        action="store_true",
        help="serve /metrics without the API key (default: it needs the key, as every route but /health)",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        help="allow CORS from this origin (repeatable; default none)",
    )
    scale = p.add_argument_group(
        "data parallelism: replicas behind the SGLang model gateway (docs/scale-out.md)"
    )
    scale.add_argument(
        "--dp",
        type=_positive,
        default=1,
        help="replicas of the server on loopback ports, behind the gateway `smg` on --host/--port "
        "(default 1: no gateway)",
    )
    scale.add_argument(
        "--policy",
        choices=POLICIES,
        default="cache_aware",
        help="the gateway's routing policy with --dp > 1 (default %(default)s)",
    )
    scale.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `smg launch` (repeatable; e.g. --gateway-arg=--retry-max-retries "
        "--gateway-arg=3)",
    )
    _engine_flags(p)
    # build_app needs transformers' tokenizer: loaded beside the children
    p.set_defaults(preload_tokenizer=True)
    return p


def _with_metrics(plugins: str | None) -> str:
    """The server's /metrics needs the metrics plugin in all three processes."""
    from engine.hooks.loader import parse_spec

    names = parse_spec(plugins if plugins is not None else envvars.read("ENGINE_PLUGINS"))
    return ",".join(names + ([] if "metrics" in names else ["metrics"]))


def _instrument(app) -> None:
    """ENGINE_TRACING=1: an HTTP server span (OpenTelemetry's own ASGI instrumentation) around each
    request, parented by the client's traceparent; the engine's request spans go under it."""
    from engine.hooks import plugin_manager
    from engine.tracing.switch import tracing_enabled

    if not tracing_enabled():
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    tracing = plugin_manager().get_plugin("tracing")
    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=tracing.provider, excluded_urls="health,metrics"
    )


def url_of(sockname: tuple) -> str:
    """http://host:port of a bound socket's address; an IPv6 host in brackets, as URLs need."""
    host, port = sockname[0], sockname[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bound_url(server) -> str:
    """The address uvicorn bound (with --port 0 the system's choice, not 0)."""
    return url_of(server.servers[0].sockets[0].getsockname())


async def _serve(app, engine, args: argparse.Namespace, name: str) -> int:
    import uvicorn

    # uvicorn's own limit is a backstop: the watcher aborts what still runs at --shutdown-timeout,
    # so streams end with finish_reason "abort" and [DONE] rather than being cut
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=args.shutdown_timeout + 10,
    )
    server = uvicorn.Server(config)
    outcome = {"code": 0}

    async def watch() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        if server.started:
            print(
                f"engine serve: ready on {bound_url(server)} (model {name!r}; pids {engine.pids})",
                flush=True,
            )
        while not server.should_exit:
            if not engine.alive:
                print(
                    "engine serve: an engine process died; stopping with exit code 1",
                    file=sys.stderr,
                    flush=True,
                )
                outcome["code"] = 1
                server.should_exit = True
            await asyncio.sleep(0.2)
        await asyncio.sleep(args.shutdown_timeout)
        # again until the server is done: a request still being tokenized now is unknown to the engine,
        # which drops its abort; it is aborted once it has been sent
        aborted: set[str] = set()
        while True:
            try:
                rids = app.state.inflight.abort_all()
            except Exception:  # noqa: BLE001 - a dead engine: its requests have failed already
                return
            new = set(rids) - aborted
            if new:
                print(
                    f"engine serve: aborted {len(new)} requests still running after --shutdown-timeout",
                    file=sys.stderr,
                    flush=True,
                )
                aborted |= new
            await asyncio.sleep(0.2)

    watcher = asyncio.ensure_future(watch())
    try:
        await server.serve()
    finally:
        watcher.cancel()
    if not server.started and outcome["code"] == 0:
        return 1  # could not bind: uvicorn said why
    return outcome["code"]


def _log_to_stderr() -> None:
    """The engine logger's warnings (an ignored request field, ...) on stderr; each message names its process."""
    logger = logging.getLogger("engine")
    if logger.handlers:  # main() run again in one process, or the embedding application's own
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)


LAUNCHER_FLAGS = ("--host", "--port", "--dp", "--policy", "--gateway-arg", "--api-key")


def replica_flags(argv: list[str]) -> list[str]:
    """The flags every replica gets: the command line less the launcher's own (and the key, which
    replicas take from the environment)."""
    launcher = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in LAUNCHER_FLAGS:
        launcher.add_argument(flag, action="append")
    return launcher.parse_known_args(argv)[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    _log_to_stderr()
    if args.dp > 1:
        from engine.serve import replicas

        return replicas.run(
            args.dp,
            replica_flags(argv),
            args.host,
            args.port,
            args.policy,
            args.gateway_arg,
            args.num_threads,
            args.shutdown_timeout,
            args.api_key or envvars.read("ENGINE_API_KEY") or None,
            args.startup_timeout,
        )
    from engine import Engine
    from engine.serve.app import ServeOptions, build_app

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    options["plugins"] = _with_metrics(options["plugins"])
    api_key = args.api_key or envvars.read("ENGINE_API_KEY") or None
    try:
        engine = Engine(**options)
    except Exception as exc:  # noqa: BLE001 - any start failure: one line, non-zero
        print(
            f"engine serve: the engine did not start: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 1
    try:
        from engine.model.resolve import model_name

        name = (
            args.served_model_name or engine.server_info.get("model") or model_name(args.model_path)
        )
        app = build_app(
            engine,
            ServeOptions(
                name, api_key, args.max_request_bytes, tuple(args.allow_origin), args.open_metrics
            ),
        )
        _instrument(app)
        # uvicorn re-raises the signal that stopped it once it is done: these handlers take it, so
        # the engine still shuts down in order and the exit code says how it went
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        return asyncio.run(_serve(app, engine, args, name))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())

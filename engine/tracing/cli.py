"""engine trace {receive,list,perfetto,timeline}: look at traces without a Jaeger at hand.

engine trace receive -o spans.jsonl            # an OTLP receiver on 127.0.0.1:4317 (gRPC) and :4318 (HTTP)
engine trace list spans.jsonl                  # the requests in a file, with their trace ids
engine trace perfetto spans.jsonl -o trace.json    # Chrome trace events: open in ui.perfetto.dev
engine trace timeline spans.jsonl -o request.png [--request RID | --trace TRACE_ID]
"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine trace", description="look at the engine's OpenTelemetry spans"
    )
    sub = p.add_subparsers(dest="command", required=True)
    rx = sub.add_parser("receive", help="run an OTLP receiver that appends what it gets to a file")
    rx.add_argument("--grpc-port", type=int, default=4317)
    rx.add_argument("--http-port", type=int, default=4318)
    rx.add_argument(
        "--output",
        "-o",
        default=None,
        help="OTLP/JSON lines file to append to (default: only count)",
    )
    rx.add_argument("--quiet", action="store_true", help="print only the endpoints line")
    ls = sub.add_parser("list", help="the requests in an OTLP/JSON lines file")
    ls.add_argument("file")
    pf = sub.add_parser(
        "perfetto", help="convert to a Chrome trace-event file (Perfetto, chrome://tracing)"
    )
    pf.add_argument("file")
    pf.add_argument("--output", "-o", default="trace.json")
    tl = sub.add_parser("timeline", help="draw one request's spans as a PNG timeline")
    tl.add_argument("file")
    tl.add_argument("--output", "-o", default="request.png")
    tl.add_argument(
        "--request", default=None, help="request id (default: the first request in the file)"
    )
    tl.add_argument("--trace", default=None, help="trace id (instead of --request)")
    tl.add_argument("--width", type=int, default=1400)
    return p


def _receive(args) -> int:
    import signal

    from engine.tracing.receiver import OTLPReceiver

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # print the final count on terminate too
    with OTLPReceiver(args.grpc_port, args.http_port, out_path=args.output, keep=False) as rx:
        where = args.output or "counted only"
        print(
            f"OTLP receiver: gRPC {rx.grpc_endpoint}, HTTP {rx.http_endpoint}/v1/traces -> {where} (Ctrl-C stops)",
            flush=True,
        )
        seen = 0
        try:
            while True:
                time.sleep(1.0)
                n = rx.export_count
                if n != seen and not args.quiet:
                    print(f"  {n} exports, {rx.span_count} spans", flush=True)
                    seen = n
        finally:
            print(f"received {rx.span_count} spans in {rx.export_count} exports", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from engine.tracing.otlp_json import read_spans

    try:
        if args.command == "receive":
            return _receive(args)
        spans = read_spans(args.file)
        if args.command == "list":
            from engine.tracing.timeline import request_traces

            traces = request_traces(spans)
            width = max([len("request id")] + [len(rid) for _, rid, _ in traces])
            print(f"{'trace id':<32}  {'request id':<{width}}  root span")
            for trace_id, rid, name in traces:
                print(f"{trace_id:<32}  {rid:<{width}}  {name}")
            if not traces:
                print("(no request traces in the file)", file=sys.stderr)
        elif args.command == "perfetto":
            from engine.tracing.perfetto import write_chrome_trace

            n = write_chrome_trace(spans, args.output)
            print(f"{args.output}: {n} spans; open it in https://ui.perfetto.dev")
        else:
            from engine.tracing.timeline import draw_timeline

            trace_id = draw_timeline(spans, args.output, args.request, args.trace, args.width)
            print(f"{args.output}: trace {trace_id}")
    except (OSError, ValueError) as exc:
        print(f"engine trace {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

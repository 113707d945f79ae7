"""Tracing's cost, side by side in one script: the throughput workload with tracing off and on.

The tracing plugin is loaded per process, so the two configurations cannot share a user process:
each round starts one engine per configuration in a subprocess (order alternating between rounds),
warms it up, and times the workload twice. "on" exports every span (requests and steps) over
OTLP/gRPC with the batch span processor to a receiver running in its own process, as a collector
would; the receiver counts what arrived.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from engine.bench.plugins import throughput
from engine.bench.prompts import build_prompts

TIMED_RUNS = 2  # per engine start


def _child(args: argparse.Namespace) -> None:
    from engine import Engine

    with Engine(dtype=args.plugin_dtype) as eng:
        prompts = build_prompts(
            eng.tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed
        )
        eng.generate(
            input_ids=[p[::-1][:32] for p in prompts[:2]], sampling_params={"max_new_tokens": 4}
        )
        rates = [throughput(eng, prompts, args.plugin_new_tokens) for _ in range(TIMED_RUNS)]
        stats = eng.get_stats()
    print(
        "RESULT "
        + json.dumps(
            {
                "rates": rates,
                "steps": stats["prefill_steps"] + stats["decode_steps"],
                "requests": stats["finished_requests"],
            }
        ),
        flush=True,
    )


def _start_receiver() -> tuple[subprocess.Popen, str]:
    """A receiver in its own process that only counts (as a collector elsewhere would cost the engine
    nothing; converting spans to JSON here would take CPU from the engine on this small machine)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "trace",
            "receive",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # "OTLP receiver: gRPC http://127.0.0.1:PORT, HTTP ..."
    endpoint = line.split("gRPC ", 1)[1].split(",", 1)[0]
    return proc, endpoint


def _child_args(args: argparse.Namespace) -> list[str]:
    return [
        "--plugin-dtype",
        args.plugin_dtype,
        "--num-prompts",
        str(args.num_prompts),
        "--min-len",
        str(args.min_len),
        "--max-len",
        str(args.max_len),
        "--seed",
        str(args.seed),
        "--plugin-new-tokens",
        str(args.plugin_new_tokens),
    ]


def run_tracing(args: argparse.Namespace) -> dict:
    rates: dict[str, list[float]] = {"off": [], "on": []}
    info: dict = {}
    receiver, endpoint = _start_receiver()
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ENGINE_TRACE"))}
        envs = {
            "off": dict(base, ENGINE_PLUGINS=""),
            "on": dict(
                base, ENGINE_PLUGINS="", ENGINE_TRACING="1", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint
            ),
        }
        for r in range(args.plugin_rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                print(f"[tracing] round {r + 1}: tracing {mode} ...", flush=True)
                cmd = [sys.executable, "-m", "engine.bench.tracing", "--child", *_child_args(args)]
                run = subprocess.run(
                    cmd, env=envs[mode], capture_output=True, text=True, timeout=1800
                )
                if run.returncode != 0:
                    raise RuntimeError(
                        f"tracing benchmark child ({mode}) failed:\n{run.stderr[-3000:]}"
                    )
                result = json.loads(
                    next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))[7:]
                )
                rates[mode] += result["rates"]
                info[mode] = result
    finally:
        receiver.terminate()
        last, _ = receiver.communicate(timeout=30)  # "received N spans in M exports"
    received = int(last.strip().splitlines()[-1].split()[1])
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print("[tracing] the plugin's CPU time per step, in process ...", flush=True)
    return {
        "plugin_cpu": plugin_cpu_cost(),
        "rounds": args.plugin_rounds,
        "timed_runs_per_round": TIMED_RUNS,
        "tokens_per_s": rates,
        "median_off": off,
        "median_on": on,
        "on_loss_pct": 100 * (1 - on / off),
        "spans_received": received,
        "steps_per_engine": info.get("on", {}).get("steps"),
        "requests_per_engine": info.get("on", {}).get("requests"),
    }


class _EncodeOnlyExporter:
    """Serializes spans as the OTLP exporter does, then drops them: the CPU cost without a network."""

    def export(self, spans):
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export import SpanExportResult

        encode_spans(spans).SerializeToString()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def plugin_cpu_cost(batch: int = 64, steps: int = 300) -> dict:
    """The plugin's own CPU time per scheduler step and per finished request, in this process: spans
    made, queued and serialized (the batch processor's export included via force_flush)."""
    import time

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from engine.hooks.types import StepRecord
    from engine.sampling_params import SamplingParams
    from engine.scheduler.request import Req
    from engine.tracing.context import format_traceparent
    from engine.tracing.plugin import TracingPlugin

    plugin = TracingPlugin()
    plugin.provider = TracerProvider(resource=Resource.create({}), shutdown_on_exit=False)
    plugin.provider.add_span_processor(
        BatchSpanProcessor(_EncodeOnlyExporter(), max_queue_size=1 << 16)
    )
    plugin.tracer = plugin.provider.get_tracer("bench")
    now = time.time_ns()
    reqs = []
    for i in range(batch):
        req = Req(
            f"r{i}",
            [1] * 100,
            SamplingParams(),
            (2,),
            trace_context={"traceparent": format_traceparent(i + 1, i + 1, 1)},
            arrived_ns=now,
        )
        req.admitted_ns, req.first_token_ns, req.output_ids = now + 1000, now + 2000, [5] * 64
        reqs.append(req)
    record = StepRecord("decode", reqs, batch, now, now + 10, now + 20, now + 30, now + 40)
    cpu0 = time.process_time()
    for _ in range(steps):
        plugin.engine_step_end(step=record)
    plugin.provider.force_flush()
    per_step = (time.process_time() - cpu0) / steps
    cpu0 = time.process_time()
    for _ in range(steps // batch + 1):
        for req in reqs:
            plugin.engine_request_finished(req=req, finish_reason={"type": "length"})
    plugin.provider.force_flush()
    per_request = (time.process_time() - cpu0) / ((steps // batch + 1) * batch)
    plugin.provider.shutdown()
    return {
        "batch": batch,
        "cpu_us_per_step": per_step * 1e6,
        "cpu_us_per_finished_request": per_request * 1e6,
    }


def print_tracing(r: dict) -> None:
    print(
        "\ntracing: throughput workload, off against on (OTLP/gRPC, batch span processor), median of runs"
    )
    print(
        f"  tracing off                 {r['median_off']:10.1f} tok/s   "
        f"runs {['%.1f' % x for x in r['tokens_per_s']['off']]}"
    )
    print(
        f"  tracing on                  {r['median_on']:10.1f} tok/s   "
        f"runs {['%.1f' % x for x in r['tokens_per_s']['on']]}"
    )
    print(f"  loss with tracing on        {r['on_loss_pct']:9.1f}%")
    print(
        f"  spans received              {r['spans_received']:10d}   ({r['requests_per_engine']} requests, "
        f"{r['steps_per_engine']} steps per engine)"
    )
    c = r["plugin_cpu"]
    print(
        f"  plugin CPU per step         {c['cpu_us_per_step']:9.0f} us   (a decode step of {c['batch']} requests: "
        "step trace, 5 spans, links; serialized)"
    )
    print(
        f"  plugin CPU per request      {c['cpu_us_per_finished_request']:9.0f} us   (queue, prefill, decode spans)",
        flush=True,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description="tracing benchmark child (run by python -m engine.bench --workload tracing)"
    )
    p.add_argument("--child", action="store_true", required=True)
    p.add_argument("--plugin-dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plugin-new-tokens", type=int, default=64)
    _child(p.parse_args())

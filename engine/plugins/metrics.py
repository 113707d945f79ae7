"""metrics: Prometheus metrics of the engine, on the existing hooks, with prometheus_client.

Names and meanings follow the SGLang / vLLM dashboards users know, under one prefix `engine:`
(docs/server.md lists them). Where each figure comes from:

- user process: engine_request_done gives every finished request's meta_info: token counters,
  finished requests by reason, time to first token, time per output token, end-to-end latency. A
  prompt with n > 1 counts its prompt tokens once (its first copy), as usage does; a request that
  ends with an error (never sent, or cut off by the engine stopping or dying) never finished and
  counts nowhere;
- scheduler: engine_request_admitted gives each request's queue time (sent by the user process ->
  first admission), kept as histogram buckets and handed over through engine_stats;
- at scrape time, engine.get_stats() of the engines alive in this process: requests running and
  waiting, KV pool usage, prefix cache hit rate, and the scheduler's queue-time histogram.

`engine serve` serves them at /metrics; an offline Engine serves them on 127.0.0.1 at
ENGINE_METRICS_PORT when that is set (`ENGINE_PLUGINS=metrics ENGINE_METRICS_PORT=9400 python run.py`).
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref

from engine import envvars
from engine.hooks import hookimpl

logger = logging.getLogger(__name__)

PREFIX = "engine:"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
QUEUE_BUCKETS = TTFT_BUCKETS

_lock = threading.Lock()
_user = None  # the user process's metrics (prometheus_client objects), made on first use
_queue = {"counts": [0] * (len(QUEUE_BUCKETS) + 1), "sum": 0.0, "count": 0}  # scheduler: queue time
# user process: each live engine's last queue-time figures read (by its id, a weak reference to it beside), and the
# figures of engines gone since: a cumulative histogram must never go down (Prometheus reads a drop
# as a reset), whether an engine shut down or one scrape could not read it
_queue_seen: dict[int, tuple[weakref.ref, dict]] = {}
_queue_gone = {"counts": [0] * (len(QUEUE_BUCKETS) + 1), "sum": 0.0, "count": 0}
# one scrape at a time (they run in worker threads): the bookkeeping above
_scrape_lock = threading.Lock()
# stays in order; not _lock, which the hooks take while a scrape waits for get_stats
_http = None  # the ENGINE_METRICS_PORT server of this process, while an engine runs
# two engines starting in two threads check and bind the port one at a time
_http_lock = threading.Lock()
# user process: seqs of the 2nd..nth copies of an n > 1 prompt, until done
_copies: set[int] = set()
_announcing = threading.local()  # the PromptRequest this thread announced last (a weak reference)


class _UserMetrics:
    """The user process's registry: counters and histograms fed by hooks, gauges read at scrape time."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            PREFIX + "cached_prompt_tokens",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason (stop, length, abort)",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from submission to the first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from submission to the last output",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        r.register(_ScrapeCollector())

    def observe(self, meta: dict, copy: bool = False) -> None:
        """A finished request; a copy (of an n > 1 prompt, not the first) adds no prompt tokens."""
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        self.finished.labels(finished_reason=reason).inc()
        if not copy:
            self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
            self.cached_tokens.inc(meta.get("cached_tokens", 0))
        completion = meta.get("completion_tokens", 0)
        self.generation_tokens.inc(completion)
        e2e, first = meta.get("e2e_latency"), meta.get("first_token_latency")
        if e2e is not None:
            self.e2e.observe(e2e)
        if first is not None and completion > 0:
            self.ttft.observe(first)
            if completion > 1 and e2e is not None:
                self.tpot.observe(max(0.0, e2e - first) / (completion - 1))


class _ScrapeCollector:
    """Gauges and the scheduler's queue-time histogram, from get_stats() of the live engines."""

    def describe(self):
        return []

    def collect(self):
        with _scrape_lock:
            yield from self._collect()

    def _collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        from engine.frontend.engine import live_engines

        running = GaugeMetricFamily(
            PREFIX + "num_requests_running", "Requests in the running batch"
        )
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting", "Requests waiting for admission"
        )
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Share of the KV pool in use (prefix cache included), 0-1",
        )
        hit = GaugeMetricFamily(
            PREFIX + "prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens admitted, 0-1",
        )
        totals = {
            "running": 0.0,
            "waiting": 0.0,
            "used": 0.0,
            "size": 0.0,
            "hit": 0.0,
            "prompt": 0.0,
        }
        live = live_engines()
        _retire_gone(live)
        for eng in live:
            try:
                stats = eng.get_stats()
            except Exception:  # noqa: BLE001 - a dead or stopping engine: its last figures stand in
                continue
            totals["running"] += stats.get("running", 0)
            totals["waiting"] += stats.get("waiting", 0)
            totals["size"] += stats.get("max_total_tokens", 0)
            totals["used"] += stats.get("max_total_tokens", 0) - stats.get("free_tokens", 0)
            totals["hit"] += stats.get("prompt_cache_hit_tokens", 0)
            totals["prompt"] += stats.get("prompt_tokens", 0)
            queue = (
                stats.get("plugins", {}).get("scheduler", {}).get("metrics", {}).get("queue_time")
            )
            if queue:
                with _lock:
                    _queue_seen[id(eng)] = (weakref.ref(eng), queue)
        with _lock:
            parts = [_queue_gone, *(queue for _, queue in _queue_seen.values())]
        counts = [sum(p["counts"][i] for p in parts) for i in range(len(QUEUE_BUCKETS) + 1)]
        qsum = sum(p["sum"] for p in parts)  # the count is the +Inf bucket's
        running.add_metric([], totals["running"])
        waiting.add_metric([], totals["waiting"])
        usage.add_metric([], totals["used"] / totals["size"] if totals["size"] else 0.0)
        hit.add_metric([], totals["hit"] / totals["prompt"] if totals["prompt"] else 0.0)
        queue_hist = HistogramMetricFamily(
            PREFIX + "request_queue_time_seconds",
            "Time from submission to first admission by the scheduler",
        )
        cumulative, buckets = 0, []
        for bound, n in zip((*QUEUE_BUCKETS, float("inf")), counts):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        queue_hist.add_metric([], buckets, qsum)
        yield from (running, waiting, usage, hit, queue_hist)


def _retire_gone(live: list) -> None:
    """Engines read before that are not live any more: their last figures join the ones kept for good."""
    with _lock:
        for key, (ref, queue) in list(_queue_seen.items()):
            engine = ref()
            if engine is None or not any(engine is e for e in live):
                _queue_gone["counts"] = [
                    a + b for a, b in zip(_queue_gone["counts"], queue["counts"])
                ]
                _queue_gone["sum"] += queue["sum"]
                _queue_gone["count"] += queue["count"]
                del _queue_seen[key]


def user_metrics() -> _UserMetrics:
    """This process's metrics registry (the server's /metrics renders it)."""
    global _user
    with _lock:
        if _user is None:
            _user = _UserMetrics()
        return _user


def render() -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(user_metrics().registry), CONTENT_TYPE_LATEST


# ---------------------------------------------------------------------- hooks


@hookimpl
def engine_process_ready(role: str, pid: int, info: dict) -> None:
    """User process: with ENGINE_METRICS_PORT, serve /metrics on 127.0.0.1 (once per process)."""
    global _http
    if role != "user":
        return
    user_metrics()
    port = envvars.read("ENGINE_METRICS_PORT")
    if not port:
        return
    with _http_lock:
        if _http is None:
            from prometheus_client import start_http_server

            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"ENGINE_METRICS_PORT={port!r}: give a TCP port number")
            _http = start_http_server(int(port), addr="127.0.0.1", registry=user_metrics().registry)
            logger.info("engine metrics: http://127.0.0.1:%s/metrics", port)


@hookimpl
def engine_process_stop(role: str, pid: int) -> None:
    """The metrics port closes with the last engine of the process."""
    global _http
    if role != "user":
        return
    from engine.frontend.engine import live_engines

    with _http_lock:
        if _http is None or live_engines():
            return
        server, thread = _http
        _http = None
    server.shutdown()
    server.server_close()
    thread.join(5)


@hookimpl
def engine_request_submitted(rid: str, request, sampling, trace_context: dict, seq: int) -> None:
    """User process: the copies of an n > 1 prompt are announced one after another, in one thread,
    with the same PromptRequest; those after the first are marked, so the prompt counts once."""
    last = getattr(_announcing, "request", None)
    if last is not None and last() is request:
        with _lock:
            _copies.add(seq)
    _announcing.request = weakref.ref(request)


@hookimpl
def engine_request_done(rid: str, meta_info: dict, error: str | None, seq: int) -> None:
    with _lock:
        copy = seq in _copies
        _copies.discard(seq)
    # else it never finished: not sent, or cut off by the engine stopping or dying
    if error is None:
        user_metrics().observe(meta_info, copy)


@hookimpl
def engine_request_admitted(req, cached_tokens: int) -> None:
    """Scheduler: the queue time of a request's first admission."""
    if req.admissions != 1 or not req.arrived_ns or not req.admitted_ns:
        return
    seconds = max(0.0, (req.admitted_ns - req.arrived_ns) / 1e9)
    with _lock:
        _queue["counts"][bisect.bisect_left(QUEUE_BUCKETS, seconds)] += 1
        _queue["sum"] += seconds
        _queue["count"] += 1


@hookimpl
def engine_stats(role: str) -> dict | None:
    if role != "scheduler":
        return None
    with _lock:
        return {
            "queue_time": {
                "counts": list(_queue["counts"]),
                "sum": _queue["sum"],
                "count": _queue["count"],
            }
        }

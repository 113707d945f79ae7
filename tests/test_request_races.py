"""Issue 13, items 1, 7, 8 and 11: head_dim 40 end to end, a stream finalised under the tokenizer
manager's lock, an old abort meeting a reused rid, and submits racing shutdown. Real processes, real ZMQ."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import msgspec
import pytest

from engine.errors import EngineDeadError
from engine.ipc.messages import STOP_STRING_MATCHED, AbortRequest, TokenizedRequest
from engine.sampling_params import SamplingParams

LONG = {"max_new_tokens": 80, "ignore_eos": True, "temperature": 0}


def test_head_dim_40_serves_with_the_default_backend(tiny_engine):
    """Item 1: the native extend kernel refused head_dim % 16 != 0 with code 1 in every prefill."""
    outs = tiny_engine.generate(
        input_ids=[[1, 2, 3, 4], [1] + list(range(100, 160))],
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "length", "length": 6}] * 2


def test_stream_finalised_by_gc_under_the_states_lock_does_not_deadlock(tiny_engine, monkeypatch):
    """Item 7: the garbage collector may run a dropped Stream's finalizer in a thread that holds
    states_lock (the receiver thread does, often); the abort it makes must not take that lock inline."""
    tm = tiny_engine._resources.tokenizer_manager
    queued: list[list[str]] = []
    sent: list[list[str]] = []
    abort_soon, send_abort = tm.abort_soon, tm.aborts._send_abort
    monkeypatch.setattr(
        tm,
        "abort_soon",
        lambda states, *a: (queued.append([s.rid for s in states]), abort_soon(states, *a)),
    )
    monkeypatch.setattr(
        tm.aborts,
        "_send_abort",
        lambda live, *a: (sent.append([s.rid for s in live]), send_abort(live, *a)),
    )
    stream = tiny_engine.generate(
        input_ids=[1, 5, 6], sampling_params=LONG, rid="gc-dropped", stream=True
    )
    state = tm.requests.states["gc-dropped"]
    cycle: dict = {"stream": stream}
    cycle["self"] = cycle  # only the cycle collector can free it now
    del stream, cycle
    finished = threading.Event()

    def collect_under_lock() -> None:
        with tm.requests.lock:
            gc.collect()
        finished.set()

    gc.disable()
    try:
        worker = threading.Thread(target=collect_under_lock, daemon=True)
        worker.start()
        assert finished.wait(10), (
            "deadlock: the finalizer took states_lock in the thread that holds it"
        )
    finally:
        gc.enable()
    assert queued == [["gc-dropped"]]  # the finalizer queued the abort instead of taking the lock
    assert state.done.wait(10)
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tm.aborts._deferred  # and the receiver thread sent it, unless the request ended:
    # a collection of a large heap can outlast the 80 tokens
    assert (
        sent == [["gc-dropped"]] and state.finish_reason.type == "abort"
    ) or state.finish_reason.length == 80, (sent, state.finish_reason)
    assert tiny_engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})[
        "output_ids"
    ]


@pytest.fixture
def run(tiny_scheduler):
    return tiny_scheduler


def test_old_abort_does_not_stop_a_new_request_reusing_the_rid(run):
    """Item 8: the detokenizer's stop-string abort for `x` (submission 1) arrives after the user
    process, which saw `x` finish, submitted a new `x` (submission 2)."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    run.submit(TokenizedRequest("x", [1, 2, 3], params, seq=1))
    assert [(rid, f.type) for rid, f in run.finish_all()] == [("x", "length")]
    run.submit(TokenizedRequest("x", [1, 2, 3], params, seq=2))
    run.requests.send(run.codec.encode(AbortRequest(["x"], STOP_STRING_MATCHED, [1])))
    assert run.sched.recv_sock.poll(5000)
    # the new one ran to its length
    assert [(rid, f.type) for rid, f in run.finish_all()] == [("x", "length")]


def test_a_reused_rid_supersedes_the_request_still_running_under_it(run):
    """Item 8: the new `x` arrives while the old one, stopped by the detokenizer, still runs here. The old
    one ends first (its outputs are dropped by the detokenizer); the abort, arriving later, hits nothing."""
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    run.submit(TokenizedRequest("y", [1, 2, 3], params, seq=7))
    assert run.sched.run_once(block=False) and run.sched.run_once(block=False)
    run.submit(
        TokenizedRequest("y", [4, 5, 6], msgspec.structs.replace(params, max_new_tokens=3), seq=8)
    )
    run.requests.send(run.codec.encode(AbortRequest(["y"], STOP_STRING_MATCHED, [7])))
    assert run.sched.recv_sock.poll(5000)
    finishes = run.finish_all()
    assert [(rid, f.type) for rid, f in finishes] == [("y", "abort"), ("y", "length")], finishes
    assert "superseded" in finishes[0][1].message and finishes[1][1].length == 3


def test_abort_from_the_user_process_names_the_submission(tiny_engine):
    tm = tiny_engine._resources.tokenizer_manager
    states, _ = tm.submit(input_ids=[1, 7], sampling_params=LONG, rid="named")
    assert states[0].seq > 0
    tm.abort(["named"])
    assert states[0].done.wait(10) and states[0].finish_reason.type == "abort"


def test_submits_racing_shutdown_get_results_or_engine_dead_error(tiny_engine, tmp_path):
    """Item 11: shutdown closes the sockets while other threads submit, abort and wait: each call
    returns or raises EngineDeadError; nothing else escapes, and the process survives."""
    from engine import Engine

    eng = Engine(
        model_path=tiny_engine.model_dir, dtype="float32", max_total_tokens=2048, context_length=96
    )
    # a submit worker starts
    asyncio.run(eng.async_generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1}))
    from engine.frontend.streaming import _submitters

    workers = list(_submitters[eng._resources.tokenizer_manager]._threads)
    assert workers
    errors: list[BaseException] = []
    counts = {"ok": 0, "dead": 0}
    start = threading.Barrier(5)

    def hammer(i: int) -> None:
        # straight to submit: a thread is nearly always sending
        tm = eng._resources.tokenizer_manager
        start.wait()
        for j in range(1_000_000):
            try:
                tm.submit(
                    input_ids=[1, 2 + i, 3 + j % 50],
                    sampling_params={"max_new_tokens": 1},
                    rid=f"h{i}-{j}",
                )
                tm.abort([f"h{i}-{j}"])
                counts["ok"] += 1
            except EngineDeadError:
                counts["dead"] += 1
                return
            except BaseException as exc:  # noqa: BLE001 - the test's point
                errors.append(exc)
                return

    threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    start.wait()
    deadline = time.monotonic() + 30
    # some submit-and-abort went through
    while counts["ok"] == 0 and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    eng.shutdown()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a caller hung across shutdown"
    assert errors == [], errors
    assert counts["ok"] > 0 and counts["dead"] == 4
    # the async submit workers end with the engine, not at garbage collection
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in workers if t.is_alive()]

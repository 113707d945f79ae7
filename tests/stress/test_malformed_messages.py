"""Messages written straight into the engine's sockets by something that is not the engine: random
bytes, truncated messages, the wrong message type for the socket, well-typed messages with wrong
contents, huge ones. Each one that does not decode, or holds what no message may (lists of unequal
length), is dropped with a log line naming the process; the well-formed ones name requests that do not
exist and change nothing; none is fatal: the engine serves on, and the request running while they
arrive is not disturbed. Its own engine (tiny model): a failure here must not take the shared one down."""

from __future__ import annotations

import os
import random
import time

import msgspec
import pytest
import zmq

from engine import Engine
from engine.bench.crowd import busy, wait_idle
from engine.ipc.messages import (
    AbortRequest,
    BatchTextOut,
    BatchTokenOut,
    Codec,
    FinishReason,
    GenerateBatch,
    Stats,
    StatsRequest,
    TokenizedRequest,
    ToDetokenizer,
    ToScheduler,
    ToTokenizer,
)
from engine.sampling_params import SamplingParams
from helpers import deeply_nested


@pytest.fixture(scope="module")
def victim(tiny_llama_dir, tmp_path_factory):
    """The engine, its children's stderr going to a file of its own (they inherit fd 2 at spawn)."""
    log = tmp_path_factory.mktemp("victim") / "stderr.log"
    saved = os.dup(2)
    with open(log, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        eng = Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    eng.stderr_log = log
    yield eng
    eng.shutdown()


def hostile_messages(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    good = [
        Codec(ToScheduler).encode(StatsRequest("x")),
        Codec(ToDetokenizer).encode(BatchTokenOut(["r"], [5], [None], [None])),
        Codec(ToTokenizer).encode(BatchTextOut(["r"], ["t"], [5], [None], [None])),
    ]
    out = [
        b"",
        b"\x00",
        rng.randbytes(64),
        b"\xc1" * 10,
        msgspec.msgpack.encode({"a": 1}),
        msgspec.msgpack.encode([1, 2, 3]),
        # a GenerateBatch with bad fields
        msgspec.msgpack.encode(["generate", [["rid", [-1, 10**12], None]]]),
        # lists of unequal length
        msgspec.msgpack.encode(["tokens", ["a", "b"], [1], [None], [None]]),
        # a token id no vocabulary has
        msgspec.msgpack.encode(["tokens", ["a"], [2**40], [None], [None]]),
        msgspec.msgpack.encode(["text", ["a"], ["x"], [1], [None]]),
        msgspec.msgpack.encode(["abort", [], "x", []]),
        # lists of unequal length
        msgspec.msgpack.encode(["text", ["a", "b"], ["x"], [1], [None], [None]]),
        rng.randbytes(8 << 20),
    ]
    for g in good:
        out += [g[: len(g) // 2], g + b"\x00", g[:1]]
    out += good  # well-formed, but for another socket, or naming requests that do not exist
    out += [
        Codec(ToDetokenizer).encode(
            BatchTokenOut(["ghost"], [3], [FinishReason("length", length=1)], [None])
        ),
        Codec(ToScheduler).encode(AbortRequest(["ghost"], "x", [0])),
    ]
    # nested past msgspec's depth in a field of any value: RecursionError, not a DecodeError, killed the detokenizer
    ghost = TokenizedRequest("ghost", [1], SamplingParams(custom_params={"k": "NEST"}))
    out += [
        deeply_nested(GenerateBatch([ghost])),
        deeply_nested(Stats("x", 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, {}, plugins={"p": "NEST"})),
    ]
    return out


@pytest.mark.parametrize("target", ["scheduler", "detokenizer", "tokenizer"])
def test_hostile_messages_are_dropped_not_fatal(victim, target, caplog):
    role = {"tokenizer": "tokenizer_manager"}.get(target, target)
    endpoint = getattr(victim._resources.endpoints, target)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    codec = Codec(
        {"scheduler": ToScheduler, "detokenizer": ToDetokenizer, "tokenizer": ToTokenizer}[target]
    )
    params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    user, line = "", f"engine::{role}: dropped a malformed message"
    err = ""  # the user process's log records (the tokenizer manager's: pytest takes them), then the children's stderr
    try:
        running = victim.generate("Once upon a time", params, stream=True)
        first = next(iter(running))
        messages = hostile_messages(len(target))
        undecodable = sum(1 for data in messages if not _decodes(codec, data))
        for data in messages:
            sock.send(data)
        # every message that cannot decode is dropped, named, while the request runs
        deadline = time.monotonic() + 60
        while err.count(line) < undecodable and time.monotonic() < deadline:
            time.sleep(0.05)
            user = caplog.text
            err = user + victim.stderr_log.read_text(errors="replace")
        assert err.count(line) >= undecodable > 0, (undecodable, err[-2000:])
        rest = list(running)
        assert victim.alive, "a hostile message took the engine down"
        assert rest, "the request ended before the messages were read"
        out = victim.generate("Once upon a time", params)
        streamed = first["output_ids"] + [i for c in rest for i in c["output_ids"]]
        assert streamed == out["output_ids"] and len(out["output_ids"]) == 400
        assert not busy(wait_idle(victim))
    finally:
        sock.close()
        ctx.term()
    err = caplog.text + victim.stderr_log.read_text(errors="replace")
    # well-typed, but lists of unequal length: refused, not cut short
    if target in (
        "detokenizer",
        "tokenizer",
    ):
        assert "rids but lists of" in err, err[-2000:]


def _decodes(codec: Codec, data: bytes) -> bool:
    try:
        codec.decode(data)
    except msgspec.DecodeError:
        return False
    return True


def test_sockets_and_their_directory_are_private(victim):
    runtime = victim.runtime_dir
    st = os.stat(runtime)
    assert st.st_uid == os.getuid() and (st.st_mode & 0o777) == 0o700
    sockets = [os.path.join(runtime, name) for name in os.listdir(runtime)]
    assert {os.path.basename(s) for s in sockets} >= {"scheduler", "detokenizer", "tokenizer"}
    for path in sockets:
        mode = os.stat(path).st_mode & 0o777
        assert mode & 0o077 == 0, f"{path} is mode {mode:o}"

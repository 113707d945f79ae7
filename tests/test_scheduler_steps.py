"""The scheduler driven in-process, one loop turn at a time, over real ZMQ sockets: a step that fails
aborts only its own requests, frees their memory, and the scheduler goes on serving."""

from __future__ import annotations

import pytest
import zmq

from engine.config import EngineConfig
from engine.ipc.channels import Endpoints, pull_socket, push_socket
from engine.ipc.messages import (
    NO_TOKEN,
    BatchTokenOut,
    BeamSearchOut,
    Codec,
    FinishReason,
    GenerateBatch,
    ToDetokenizer,
    ToScheduler,
    TokenizedRequest,
)
from engine.sampling_params import SamplingParams
from engine.model.forward_batch import ForwardMode


def _drain(sock, codec) -> list[BatchTokenOut]:
    """Everything the scheduler sent. ZMQ delivers in the background: wait until the socket stays quiet."""
    out = []
    while sock.poll(500):
        out.append(codec.decode(sock.recv()))
    return out


def test_failed_step_aborts_only_its_requests(tiny_llama_dir):
    from engine.scheduler.scheduler import Scheduler

    endpoints = Endpoints.create()
    ctx = zmq.Context()
    closers = []
    try:
        outputs = pull_socket(ctx, endpoints.detokenizer)
        requests = push_socket(ctx, endpoints.scheduler)
        config = EngineConfig(dtype="float32", max_total_tokens=1024, max_running_requests=4)
        sched = Scheduler(config, tiny_llama_dir, endpoints.to_dict())
        closers.append(sched.close)
        send = Codec(ToScheduler)
        requests.send(b"\x93not a message")  # malformed bytes are dropped, not fatal
        assert sched.recv_sock.poll(5000)
        assert not sched.run_once(block=False)
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        requests.send(
            send.encode(GenerateBatch([TokenizedRequest("doomed", [1, 5, 9, 13], params)]))
        )
        assert sched.recv_sock.poll(5000)  # arrived
        assert sched.run_once(block=False)  # prefill "doomed"; it joins the running batch

        real_forward = sched.forward
        calls = []

        def failing_forward(step):
            if not calls:
                calls.append(step)
                raise RuntimeError("injected failure")
            return real_forward(step)

        sched.forward = failing_forward
        assert sched.run_once(block=False)  # its decode step fails
        requests.send(
            send.encode(GenerateBatch([TokenizedRequest("survivor", [1, 7, 7, 7, 2], params)]))
        )
        assert sched.recv_sock.poll(5000)
        while sched.run_once(block=False):
            pass
        messages = _drain(outputs, Codec(ToDetokenizer))
        finishes = {
            rid: reason
            for m in messages
            for rid, reason in zip(m.rids, m.finished)
            if reason is not None
        }
        assert (
            finishes["doomed"].type == "abort" and "injected failure" in finishes["doomed"].message
        )
        assert finishes["survivor"].type == "length" and finishes["survivor"].length == 6
        tokens = [t for m in messages for rid, t in zip(m.rids, m.token_ids) if rid == "survivor"]
        assert len(tokens) == 6
        stats = sched.stats("s")
        assert stats.free_tokens + stats.cache_tokens == stats.max_total_tokens
        assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0
        assert stats.aborted_requests == 1 and stats.finished_requests == 1
    finally:
        for close in closers:
            close()
        ctx.destroy(linger=0)
        endpoints.remove()


class _Counted:
    """The scheduler's output socket, counting the messages sent through it."""

    def __init__(self, sock) -> None:
        self.sock, self.sent = sock, 0

    def send(self, data, *args, **kwargs):
        self.sent += 1
        return self.sock.send(data, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


class InProcess:
    """A Scheduler in this process with real sockets on both sides, driven one loop turn at a time."""

    def __init__(self, model_dir: str, dtype: str = "float32", **options) -> None:
        from engine.scheduler.scheduler import Scheduler

        self.endpoints = Endpoints.create()
        self.ctx = zmq.Context()
        self.outputs = pull_socket(self.ctx, self.endpoints.detokenizer)
        self.requests = push_socket(self.ctx, self.endpoints.scheduler)
        self.sched = Scheduler(
            EngineConfig(dtype=dtype, **options), model_dir, self.endpoints.to_dict()
        )
        self.sched.state.outbox.sock = _Counted(self.sched.state.outbox.sock)
        self.received = 0
        self.codec = Codec(ToScheduler)

    def submit(self, *reqs: TokenizedRequest) -> None:
        self.requests.send(self.codec.encode(GenerateBatch(list(reqs))))
        assert self.sched.recv_sock.poll(5000)

    def messages(self) -> list[BatchTokenOut]:
        """Every message the scheduler sent since the last call (counted: no quiet period to guess)."""
        codec, out = Codec(ToDetokenizer), []
        while self.received < self.sched.state.outbox.sock.sent:
            assert self.outputs.poll(60_000), (
                f"{self.sched.state.outbox.sock.sent - self.received} messages never came"
            )
            out.append(codec.decode(self.outputs.recv()))
            self.received += 1
        return out

    def finish_all(self) -> list[tuple[str, object]]:
        """Run until nothing is left; (rid, FinishReason) of every request that finished, in order."""
        while self.sched.run_once(block=False):
            pass
        out = []
        for m in self.messages():
            # a beam search's one message: its best hypothesis's ending
            if isinstance(m, BeamSearchOut):
                out.append(
                    (
                        m.rid,
                        m.hypotheses[0].finish
                        if m.hypotheses
                        else FinishReason("length", length=0),
                    )
                )
            else:
                out += [(rid, f) for rid, f in zip(m.rids, m.finished) if f is not None]
        return out

    def close(self) -> None:
        self.sched.close()
        self.ctx.destroy(linger=0)
        self.endpoints.remove()


def test_long_prompt_is_chunked_between_decode_steps(model_dir):
    """A 1,024-token prompt arriving while 16 requests decode does not stall them for its whole prefill:
    decode steps alternate with its chunks. (Eight chunks of 128: the same steps as 4,000 tokens in
    chunks of 512, at a quarter of the compute or less.)"""
    run = InProcess(
        model_dir, max_total_tokens=12000, max_running_requests=32, chunked_prefill_size=128
    )
    try:
        params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
        run.submit(
            *(
                TokenizedRequest(f"short{i}", [1, 100 + i, 200 + i, 300 + i], params)
                for i in range(16)
            )
        )
        while run.sched.state.waiting or run.sched.state.plan.last_mode is not ForwardMode.DECODE:
            run.sched.run_once(block=False)
        steps: list[tuple[str, int]] = []
        real_forward = run.sched.forward

        def recording_forward(step):
            steps.append((step.mode.value, step.forward_batch.input_ids.numel()))
            return real_forward(step)

        run.sched.forward = recording_forward
        long_ids = [(i * 37) % 5000 + 10 for i in range(1024)]
        run.submit(
            TokenizedRequest("long", long_ids, SamplingParams(max_new_tokens=2, temperature=0.0))
        )
        while (
            run.sched.state.plan.chunked is not None
            or any(r.rid == "long" for r in run.sched.state.waiting)
            or not steps
        ):
            run.sched.run_once(block=False)
        chunks = [n for mode, n in steps if mode == "extend"]
        assert sum(chunks) == 1024 and max(chunks) <= 128 and len(chunks) == 8, steps
        modes = [mode for mode, _ in steps]
        # never two prefill chunks in a row
        assert all(a != b for a, b in zip(modes, modes[1:])), modes
        # every short request kept decoding
        assert all(n == 16 for mode, n in steps if mode == "decode"), steps
        while run.sched.run_once(block=False):
            pass
        outs = run.messages()
        finished = {rid for m in outs for rid, f in zip(m.rids, m.finished) if f is not None}
        assert finished == {f"short{i}" for i in range(16)} | {"long"}
        stats = run.sched.stats("s")
        assert stats.chunked_prefill_steps == 7 and stats.cache_lock_refs == 0
    finally:
        run.close()


def test_request_that_can_never_fit_fails_alone(tiny_llama_dir):
    """The user process refuses such requests up front; the scheduler's own guard names the limit."""
    run = InProcess(tiny_llama_dir, max_total_tokens=64, max_running_requests=4)
    try:
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        run.submit(
            TokenizedRequest("too-long", list(range(10, 110)), params),
            TokenizedRequest("fine", [1, 2, 3], params),
        )
        while run.sched.run_once(block=False):
            pass
        outs = run.messages()
        finishes = {rid: f for m in outs for rid, f in zip(m.rids, m.finished) if f is not None}
        assert (
            finishes["too-long"].type == "abort"
            and "max_total_tokens=64" in finishes["too-long"].message
        )
        assert finishes["fine"].type == "length"
    finally:
        run.close()


def test_failure_after_some_requests_finished_reports_each_once(tiny_llama_dir):
    """A step that raises after some of its requests finished (here: putting a prompt in the cache)
    aborts only the unfinished ones, frees nothing twice, and the scheduler serves on."""
    run = InProcess(tiny_llama_dir, max_total_tokens=256, max_running_requests=4)
    try:
        run.submit(
            TokenizedRequest(
                "one-token", [1, 2, 3], SamplingParams(max_new_tokens=1, temperature=0.0)
            ),
            TokenizedRequest(
                "continues", [4, 5, 6], SamplingParams(max_new_tokens=5, temperature=0.0)
            ),
        )
        real = run.sched.state.kv.cache_prompt
        calls = []

        def failing(req):
            if not calls:
                calls.append(req.rid)
                raise RuntimeError("injected after the finish loop")
            return real(req)

        run.sched.state.kv.cache_prompt = failing
        while run.sched.run_once(block=False):
            pass
        run.submit(
            TokenizedRequest(
                "later", [7, 8], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
            )
        )
        while run.sched.run_once(block=False):
            pass
        outs = run.messages()
        finishes = [
            (rid, f.type) for m in outs for rid, f in zip(m.rids, m.finished) if f is not None
        ]
        assert sorted(finishes) == [
            ("continues", "abort"),
            ("later", "length"),
            ("one-token", "length"),
        ]
        stats = run.sched.stats("s")
        assert stats.free_tokens + stats.cache_tokens == stats.max_total_tokens
        assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0
    finally:
        run.close()


def test_failing_custom_processor_fails_only_its_requests(tiny_llama_dir):
    from engine.sampling.processors import CustomLogitProcessor, register_logit_processor

    class Exploding(CustomLogitProcessor):
        def __call__(self, logits, batch):
            raise ValueError("boom")

    register_logit_processor("test_exploding", Exploding)  # this process is the scheduler's here
    run = InProcess(tiny_llama_dir, max_total_tokens=256, max_running_requests=4)
    try:
        run.submit(
            TokenizedRequest(
                "bad",
                [1, 2, 3],
                SamplingParams(max_new_tokens=4, custom_logit_processor="test_exploding"),
            ),
            TokenizedRequest(
                "good",
                [4, 5, 6],
                SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
            ),
        )
        while run.sched.run_once(block=False):
            pass
        outs = run.messages()
        finishes = {rid: f for m in outs for rid, f in zip(m.rids, m.finished) if f is not None}
        assert finishes["bad"].type == "abort" and "test_exploding" in finishes["bad"].message
        assert "boom" in finishes["bad"].message
        assert finishes["good"].type == "length"
        assert [t for m in outs for rid, t in zip(m.rids, m.token_ids) if rid == "bad"] == [
            NO_TOKEN
        ]
        stats = run.sched.stats("s")
        assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0
    finally:
        run.close()


def _counting_order_waiting(monkeypatch) -> list[int]:
    """Patch the waiting queue's order_waiting to count its calls (each is a match_prefix, slices and a radix
    insert per waiting request: 17.7 ms a step for 128 waiting 1,000-token requests)."""
    import engine.scheduler.waiting as waiting

    calls: list[int] = []
    real = waiting.order_waiting

    def counting(waiting, *args, **kwargs):
        calls.append(len(waiting))
        return real(waiting, *args, **kwargs)

    monkeypatch.setattr(waiting, "order_waiting", counting)
    return calls


def test_requests_finished_in_a_step_that_then_fails_are_still_answered(tiny_llama_dir):
    """The results stage marked each finishing request finished and freed it, then sent one message for
    the step: an exception freeing the second (a CUDA out-of-memory in torch.cat would do) left the first
    finished but never answered (the failure handler skips finished requests), so its caller waited
    forever. The finishes are sent before anything is freed now."""
    run = InProcess(tiny_llama_dir, max_total_tokens=512, max_running_requests=4)
    try:
        sched, real = run.sched, run.sched.state.kv.free_request
        failed = []

        def flaky(req, kv_len, keep=True):
            if req.rid == "b" and req.finished is not None and not failed:
                failed.append(req.rid)
                raise RuntimeError("injected in free_request")
            return real(req, kv_len, keep)

        sched.state.kv.free_request = flaky
        short = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        run.submit(
            TokenizedRequest("a", [1, 2, 3], short),
            TokenizedRequest("b", [1, 4, 5], short),
            TokenizedRequest(
                "c", [1, 6, 7], SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
            ),
        )
        finishes: dict[str, list] = {}
        for rid, reason in run.finish_all():
            finishes.setdefault(rid, []).append(reason)
        assert failed == ["b"]
        assert {rid: [f.type for f in reasons] for rid, reasons in finishes.items()} == {
            "a": ["length"],
            "b": ["length"],
            "c": ["abort"],
        }, finishes  # c: the failed step's other request
    finally:
        run.close()


def test_requests_retracted_before_a_retraction_fails_are_not_lost(tiny_llama_dir):
    """Memory pressure retracts requests into a list that joins the waiting queue once the loop ends:
    an exception freeing the second one (a CUDA out-of-memory in torch.cat would do) lost the first,
    out of the running batch and never queued again, never answered."""
    run = InProcess(tiny_llama_dir, max_total_tokens=64, max_running_requests=4)
    try:
        sched, real = run.sched, run.sched.state.kv.free_request
        retractions = []

        def flaky(req, kv_len, keep=True):
            if req.finished is None:  # only a retraction frees a request that has not finished
                retractions.append(req.rid)
                if len(retractions) == 2:
                    raise RuntimeError("injected in free_request")
            return real(req, kv_len, keep)

        sched.state.kv.free_request = flaky
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        rids = [f"r{i}" for i in range(4)]
        run.submit(
            *(TokenizedRequest(rid, [1, 10 + i, 20 + i], params) for i, rid in enumerate(rids))
        )
        finishes: dict[str, list] = {}
        for rid, reason in run.finish_all():
            finishes.setdefault(rid, []).append(reason.type)
        assert len(retractions) >= 2, retractions
        assert sorted(finishes) == rids and all(len(f) == 1 for f in finishes.values()), finishes
    finally:
        run.close()


@pytest.mark.parametrize("when", ["finish", "retraction"])
def test_a_free_that_raises_leaks_no_slot_lock_or_kv(tiny_llama_dir, when):
    """A request leaving the running set (finished, or retracted under memory pressure) gives its slot
    back, its lock on the cached prefix and its own K/V to the tree or the pool. When the tree's insert
    raised (a CUDA out-of-memory in its clone would), the slot, the lock and the K/V all stayed taken:
    a retracted request was even admitted again holding its old slot and lock. Each such event leaked
    for good; now the request's own K/V goes back to the pool and its slot and lock are released."""
    run = InProcess(
        tiny_llama_dir, max_total_tokens=64 if when == "retraction" else 512, max_running_requests=4
    )
    try:
        sched, cache = run.sched, run.sched.state.kv.cache
        real_insert, real_free, leaving, failed = cache.insert, sched.state.kv.free_request, [], []

        def freeing(req, kv_len, keep=True):  # which request the tree's insert is called for
            leaving.append(req)
            try:
                return real_free(req, kv_len, keep)
            finally:
                leaving.pop()

        def flaky(key, value):
            if leaving and not failed and (leaving[-1].finished is not None) == (when == "finish"):
                failed.append(leaving[-1].rid)
                raise RuntimeError("injected in the tree's insert")
            return real_insert(key, value)

        sched.state.kv.free_request, cache.insert = freeing, flaky
        params = SamplingParams(
            max_new_tokens=3 if when == "finish" else 40, temperature=0.0, ignore_eos=True
        )
        rids = [f"r{i}" for i in range(4)]
        run.submit(
            *(TokenizedRequest(rid, [1, 10 + i, 20 + i], params) for i, rid in enumerate(rids))
        )
        finishes = {rid: f for rid, f in run.finish_all()}
        assert failed and sorted(finishes) == rids, (failed, finishes)
        sched.state.kv.cache.flush()
        stats = sched.stats("s")
        assert stats.cache_lock_refs == 0
        assert stats.free_slots == stats.max_running_requests
        assert stats.free_tokens + stats.cache_tokens == stats.max_total_tokens, (
            stats.free_tokens,
            stats.cache_tokens,
        )
    finally:
        run.close()


def test_no_ordering_of_the_queue_while_nothing_can_be_admitted(tiny_scheduler, monkeypatch):
    """With every request slot taken, or the pool's headroom all reserved for the running requests,
    a prefill step cannot admit anyone: the queue is not ordered (SGLang skips it the same way)."""
    run, sched = tiny_scheduler, tiny_scheduler.sched  # 4 slots, 512 tokens
    calls = _counting_order_waiting(monkeypatch)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    run.submit(*(TokenizedRequest(f"slot{i}", [1, 10 + i, 20 + i], params) for i in range(4)))
    assert (
        sched.run_once(block=False)
        and len(sched.state.running) == 4
        and not sched.state.req_to_token.available
    )
    run.submit(TokenizedRequest("waits-for-a-slot", [1, 2, 3], params))
    calls.clear()
    for _ in range(3):
        assert sched.run_once(block=False)  # decode steps of the four
    assert calls == [] and [r.rid for r in sched.state.waiting] == ["waits-for-a-slot"]
    assert dict(run.finish_all())["waits-for-a-slot"].type == "length"
    assert calls  # ordered once a slot was free
    # the pool: three requests whose new tokens, estimated at ratio 1 (as after a retraction), reserve it all
    long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    run.submit(*(TokenizedRequest(f"pool{i}", [1, 30 + i, 40 + i], long) for i in range(3)))
    assert (
        sched.run_once(block=False)
        and len(sched.state.running) == 3
        and sched.state.req_to_token.available
    )
    run.submit(TokenizedRequest("waits-for-memory", [1, 2, 3], params))
    calls.clear()
    # the module's scheduler: back as it was for the next test
    monkeypatch.setattr(sched.state.plan, "new_token_ratio", 1.0)
    assert sched.run_once(block=False)
    assert calls == [] and [r.rid for r in sched.state.waiting] == ["waits-for-memory"]
    assert {rid: f.type for rid, f in run.finish_all()}["waits-for-memory"] == "length"
    # headroom left beyond the reservation, but less than any waiting request's least need (one prompt
    # token and its estimated new tokens): ordered every decode step before, to admit no one
    monkeypatch.setattr(sched.state.plan, "new_token_ratio", 0.5)
    run.submit(*(TokenizedRequest(f"half{i}", [1, 50 + i, 60 + i], long) for i in range(3)))
    assert sched.run_once(block=False) and len(sched.state.running) == 3
    gap = sched.state.kv.headroom - int(0.5 * sched.state.running.remaining_new_tokens(4096))
    assert 1 <= gap < 1 + int(0.5 * 480), gap
    run.submit(
        TokenizedRequest(
            "needs-more",
            [1, 2, 3],
            SamplingParams(max_new_tokens=480, temperature=0.0, ignore_eos=True),
        )
    )
    calls.clear()
    assert sched.run_once(block=False)
    assert calls == [] and [r.rid for r in sched.state.waiting] == ["needs-more"]
    assert {rid: f.type for rid, f in run.finish_all()}["needs-more"] == "length"
    stats = sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0


def test_a_request_that_cannot_start_now_holds_back_no_one_sharing_its_prefix():
    """order_waiting holds back a request that shares 32 or more uncached tokens with one admitted
    before it in the step. A request whose grammar is still compiling (or a beam search lacking slots)
    is not admitted this step: it must not hold back the requests that share its prefix."""
    from concurrent.futures import Future

    import torch

    from engine.ipc.messages import BeamParams
    from engine.memory.radix_cache import RadixCache
    from engine.scheduler.policy import order_waiting
    from engine.scheduler.request import Req

    cache = RadixCache(lambda _: None)
    shared = list(range(100, 140))
    pending: Future = Future()
    a = Req("A", shared + [1, 2], SamplingParams(regex="[0-9]+"), (2,))
    a.grammar = pending
    b = Req("B", shared + [3, 4], SamplingParams(), (2,))
    assert [r.rid for r in order_waiting([a, b], "lpm", cache, free_slots=4)] == ["A", "B"]
    pending.set_result(object())  # compiled: A goes first, B waits for A's prefix in the cache
    assert [r.rid for r in order_waiting([a, b], "lpm", cache, free_slots=4)] == ["A"]
    beam = Req("beam", shared + [5, 6], SamplingParams(), (2,), beam=BeamParams(4))
    assert [r.rid for r in order_waiting([beam, b], "fcfs", cache, free_slots=2)] == ["beam", "B"]
    assert [r.rid for r in order_waiting([beam, b], "fcfs", cache, free_slots=4)] == ["beam"]
    cache.insert(shared, torch.arange(1, 41))  # cached: no holding back
    assert [r.rid for r in order_waiting([a, b], "lpm", cache, free_slots=4)] == ["A", "B"]


def test_a_matcher_that_fails_at_admission_fails_its_request_alone(tiny_scheduler, monkeypatch):
    """grammars.matcher() raising after the request got its slot left it waiting with the slot and a
    prefix lock (overwritten without release at its next admission) and failed the requests admitted
    before it in the step."""
    from concurrent.futures import Future

    run, sched = tiny_scheduler, tiny_scheduler.sched
    compiled: Future = Future()
    compiled.set_result(object())
    monkeypatch.setattr(sched.state.grammars, "request", lambda kind, text: compiled)
    monkeypatch.setattr(sched.state.grammars, "problem", lambda future, kind: None)

    def matcher(future):
        raise RuntimeError("matcher broke")

    monkeypatch.setattr(sched.state.grammars, "matcher", matcher)
    plain = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    run.submit(
        TokenizedRequest("before", [1, 2, 3], plain),
        TokenizedRequest(
            "grammar", [1, 5, 6], SamplingParams(max_new_tokens=3, temperature=0.0, regex="[0-9]+")
        ),
        TokenizedRequest("after", [1, 7, 8], plain),
    )
    finishes = dict(run.finish_all())
    assert finishes["grammar"].type == "abort" and "matcher broke" in finishes["grammar"].message, (
        finishes
    )
    assert finishes["before"].type == "length" and finishes["after"].type == "length", finishes
    assert not sched.state.waiting
    stats = sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0


def test_sampling_tensors_that_fail_to_build_fail_only_their_request(tiny_scheduler, monkeypatch):
    """Building the prefill step's sampling tensors for one request raising (as top_k 2**63 did) aborted
    every request admitted in that step."""
    from engine.sampling import batch_params

    run, sched = tiny_scheduler, tiny_scheduler.sched
    real = batch_params.SamplingTensors.build.__func__

    def build(cls, params, *args, **kwargs):
        if any(p.seed == 666 for p in params):
            raise ValueError("Overflow when unpacking long long")
        return real(cls, params, *args, **kwargs)

    monkeypatch.setattr(batch_params.SamplingTensors, "build", classmethod(build))
    plain = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    run.submit(
        TokenizedRequest("first", [1, 2, 3], plain),
        TokenizedRequest(
            "cursed", [1, 5, 6], SamplingParams(max_new_tokens=3, seed=666, ignore_eos=True)
        ),
        TokenizedRequest("last", [1, 7, 8], plain),
    )
    finishes = dict(run.finish_all())
    assert finishes["cursed"].type == "abort" and "Overflow" in finishes["cursed"].message, finishes
    assert finishes["first"].type == "length" and finishes["last"].type == "length", finishes
    stats = sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0
    assert stats.free_tokens + stats.cache_tokens == stats.max_total_tokens


@pytest.mark.parametrize("at_step", [0, 2], ids=["start", "decode"])
def test_a_beam_selection_that_fails_fails_its_search_alone(tiny_scheduler, monkeypatch, at_step):
    """A search's selection raising (a stop list longer than its candidates made topk raise) failed the
    whole step: a plain request and another search decoding beside it were aborted with its error.
    docs/beam_search.md: that search alone fails, all its beams freed."""
    from engine.beam_search.selection import BeamSelection
    from engine.ipc.messages import BeamParams

    run, sched = tiny_scheduler, tiny_scheduler.sched
    plain = TokenizedRequest(
        "plain", [1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    )
    other = TokenizedRequest(
        "other",
        [1, 9, 4],
        SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
        beam=BeamParams(1),
    )
    doomed = TokenizedRequest(
        "doomed", [1, 7, 5], SamplingParams(max_new_tokens=7, temperature=0.0), beam=BeamParams(2)
    )
    run.submit(other)
    while sched.run_once(block=False):
        pass
    alone = [m for m in run.messages() if isinstance(m, BeamSearchOut)]
    real = BeamSelection.step

    def step(self, logprobs):
        if self.max_new == 7 and self.steps == at_step:  # the doomed search's
            raise RuntimeError("injected selection failure")
        return real(self, logprobs)

    monkeypatch.setattr(BeamSelection, "step", step)
    run.submit(plain, other, doomed)
    while sched.run_once(block=False):
        pass
    messages = run.messages()
    finishes = {
        rid: f
        for m in messages
        if isinstance(m, BatchTokenOut)
        for rid, f in zip(m.rids, m.finished)
        if f
    }
    assert (
        finishes["doomed"].type == "abort"
        and "injected selection failure" in finishes["doomed"].message
    ), finishes
    assert finishes["plain"] == FinishReason("length", length=8), finishes
    searches = [m for m in messages if isinstance(m, BeamSearchOut)]
    assert [m.rid for m in searches] == ["other"] and searches[0].hypotheses == alone[0].hypotheses
    stats = sched.stats("s")
    assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0
    assert (
        stats.free_tokens + stats.cache_tokens == stats.max_total_tokens and not sched.state.beams
    )

"""The scheduler driven in-process, one loop turn at a time, over real ZMQ sockets: a step that fails
aborts only its own requests, frees their memory, and the scheduler goes on serving."""

from __future__ import annotations

import zmq

from engine.config import EngineConfig
from engine.ipc.channels import Endpoints, pull_socket, push_socket
from engine.ipc.messages import NO_TOKEN, BatchTokenOut, Codec, GenerateBatch, ToDetokenizer, ToScheduler, TokenizedRequest
from engine.sampling_params import SamplingParams
from engine.kernels.attention import ForwardMode


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
        requests.send(send.encode(GenerateBatch([TokenizedRequest("doomed", [1, 5, 9, 13], params)])))
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
        requests.send(send.encode(GenerateBatch([TokenizedRequest("survivor", [1, 7, 7, 7, 2], params)])))
        assert sched.recv_sock.poll(5000)
        while sched.run_once(block=False):
            pass
        messages = _drain(outputs, Codec(ToDetokenizer))
        finishes = {
            rid: reason for m in messages for rid, reason in zip(m.rids, m.finished) if reason is not None
        }
        assert finishes["doomed"].type == "abort" and "injected failure" in finishes["doomed"].message
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


class InProcess:
    """A Scheduler in this process with real sockets on both sides, driven one loop turn at a time."""

    def __init__(self, model_dir: str, dtype: str = "float32", **options) -> None:
        from engine.scheduler.scheduler import Scheduler

        self.endpoints = Endpoints.create()
        self.ctx = zmq.Context()
        self.outputs = pull_socket(self.ctx, self.endpoints.detokenizer)
        self.requests = push_socket(self.ctx, self.endpoints.scheduler)
        self.sched = Scheduler(EngineConfig(dtype=dtype, **options), model_dir, self.endpoints.to_dict())
        self.codec = Codec(ToScheduler)

    def submit(self, *reqs: TokenizedRequest) -> None:
        self.requests.send(self.codec.encode(GenerateBatch(list(reqs))))
        assert self.sched.recv_sock.poll(5000)

    def messages(self) -> list[BatchTokenOut]:
        return _drain(self.outputs, Codec(ToDetokenizer))

    def finish_all(self) -> list[tuple[str, object]]:
        """Run until nothing is left; (rid, FinishReason) of every request that finished, in order."""
        while self.sched.run_once(block=False):
            pass
        return [(rid, f) for m in self.messages() for rid, f in zip(m.rids, m.finished) if f is not None]

    def close(self) -> None:
        self.sched.close()
        self.ctx.destroy(linger=0)
        self.endpoints.remove()


def test_long_prompt_is_chunked_between_decode_steps(model_dir):
    """A 1,024-token prompt arriving while 16 requests decode does not stall them for its whole prefill:
    decode steps alternate with its chunks. (Eight chunks of 128: the same steps as 4,000 tokens in
    chunks of 512, at a quarter of the compute or less.)"""
    run = InProcess(model_dir, max_total_tokens=12000, max_running_requests=32, chunked_prefill_size=128)
    try:
        params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
        run.submit(*(TokenizedRequest(f"short{i}", [1, 100 + i, 200 + i, 300 + i], params) for i in range(16)))
        while run.sched.waiting or run.sched.last_mode is not ForwardMode.DECODE:
            run.sched.run_once(block=False)
        steps: list[tuple[str, int]] = []
        real_forward = run.sched.forward

        def recording_forward(step):
            steps.append((step.mode.value, step.forward_batch.input_ids.numel()))
            return real_forward(step)

        run.sched.forward = recording_forward
        long_ids = [(i * 37) % 5000 + 10 for i in range(1024)]
        run.submit(TokenizedRequest("long", long_ids, SamplingParams(max_new_tokens=2, temperature=0.0)))
        while run.sched.chunked_req is not None or any(r.rid == "long" for r in run.sched.waiting) or not steps:
            run.sched.run_once(block=False)
        chunks = [n for mode, n in steps if mode == "extend"]
        assert sum(chunks) == 1024 and max(chunks) <= 128 and len(chunks) == 8, steps
        modes = [mode for mode, _ in steps]
        assert all(a != b for a, b in zip(modes, modes[1:])), modes  # never two prefill chunks in a row
        assert all(n == 16 for mode, n in steps if mode == "decode"), steps  # every short request kept decoding
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
        assert finishes["too-long"].type == "abort" and "max_total_tokens=64" in finishes["too-long"].message
        assert finishes["fine"].type == "length"
    finally:
        run.close()


def test_failure_after_some_requests_finished_reports_each_once(tiny_llama_dir):
    """A step that raises after some of its requests finished (here: putting a prompt in the cache)
    aborts only the unfinished ones, frees nothing twice, and the scheduler serves on."""
    run = InProcess(tiny_llama_dir, max_total_tokens=256, max_running_requests=4)
    try:
        run.submit(
            TokenizedRequest("one-token", [1, 2, 3], SamplingParams(max_new_tokens=1, temperature=0.0)),
            TokenizedRequest("continues", [4, 5, 6], SamplingParams(max_new_tokens=5, temperature=0.0)),
        )
        real = run.sched.kv.cache_prompt
        calls = []

        def failing(req):
            if not calls:
                calls.append(req.rid)
                raise RuntimeError("injected after the finish loop")
            return real(req)

        run.sched.kv.cache_prompt = failing
        while run.sched.run_once(block=False):
            pass
        run.submit(TokenizedRequest("later", [7, 8], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
        while run.sched.run_once(block=False):
            pass
        outs = run.messages()
        finishes = [(rid, f.type) for m in outs for rid, f in zip(m.rids, m.finished) if f is not None]
        assert sorted(finishes) == [("continues", "abort"), ("later", "length"), ("one-token", "length")]
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
            TokenizedRequest("bad", [1, 2, 3], SamplingParams(max_new_tokens=4, custom_logit_processor="test_exploding")),
            TokenizedRequest("good", [4, 5, 6], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)),
        )
        while run.sched.run_once(block=False):
            pass
        outs = run.messages()
        finishes = {rid: f for m in outs for rid, f in zip(m.rids, m.finished) if f is not None}
        assert finishes["bad"].type == "abort" and "test_exploding" in finishes["bad"].message
        assert "boom" in finishes["bad"].message
        assert finishes["good"].type == "length"
        assert [t for m in outs for rid, t in zip(m.rids, m.token_ids) if rid == "bad"] == [NO_TOKEN]
        stats = run.sched.stats("s")
        assert stats.free_slots == stats.max_running_requests and stats.cache_lock_refs == 0
    finally:
        run.close()

"""The scheduler driven in-process, one loop turn at a time, over real ZMQ sockets: a step that fails
aborts only its own requests, frees their memory, and the scheduler goes on serving."""

from __future__ import annotations

import zmq

from engine.config import EngineConfig
from engine.ipc.channels import Endpoints, pull_socket, push_socket
from engine.ipc.messages import BatchTokenOut, Codec, GenerateBatch, ToDetokenizer, ToScheduler, TokenizedRequest
from engine.sampling_params import SamplingParams


def _drain(sock, codec) -> list[BatchTokenOut]:
    out = []
    while sock.poll(0):
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
        assert stats.free_tokens == stats.max_total_tokens and stats.free_slots == stats.max_running_requests
        assert stats.aborted_requests == 1 and stats.finished_requests == 1
    finally:
        for close in closers:
            close()
        ctx.destroy(linger=0)
        endpoints.remove()

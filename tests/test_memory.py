"""KV pool accounting: back to idle after a batch; a pool too small for all requests queues them;
requests that could never fit are refused up front."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import PROMPTS
from engine import Engine
from engine.memory import TokenKVPool
from helpers import engine_idle


def test_pool_empty_after_batch(engine):
    outs = engine.generate(PROMPTS, {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9})
    assert len(outs) == len(PROMPTS)
    assert engine_idle(engine.get_stats())


def test_small_pool_queues_and_completes_all(engine, tokenizer):
    prompts = [tokenizer.encode(p * 3) for p in PROMPTS]
    params = {"max_new_tokens": 48, "temperature": 0}
    expected = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    need = max(len(p) for p in prompts) + 48
    # room for about two requests at a time, so the rest must wait their turn
    with Engine(dtype="float32", max_total_tokens=2 * need + 10, max_running_requests=8) as small:
        outs = small.generate(input_ids=prompts, sampling_params=params)
        stats = small.get_stats()
        with pytest.raises(ValueError, match="max_total_tokens"):  # could never fit: refused, not queued forever
            small.generate(input_ids=[5] * (stats["max_total_tokens"] - 10), sampling_params={"max_new_tokens": 64})
        assert small.get_stats()["prompt_tokens"] == stats["prompt_tokens"]
    assert [o["output_ids"] for o in outs] == expected
    assert len({o["meta_info"]["id"] for o in outs}) == len(prompts)
    assert engine_idle(stats)
    assert stats["prefill_steps"] >= len(prompts) // 2, "requests were not queued behind each other"
    assert stats["retracted_requests"] == 0  # the default estimate of new tokens is cautious enough here
    assert stats["finished_requests"] == len(prompts)


def test_prompt_longer_than_context_is_refused_up_front(engine):
    before = engine.get_stats()
    with pytest.raises(ValueError, match="context_length"):
        engine.generate(input_ids=[5] * engine.server_info["context_length"])
    after = engine.get_stats()
    assert after["prompt_tokens"] == before["prompt_tokens"]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pool_takes_memory_only_as_tokens_are_written(dtype):
    """The pool is sized from free memory (2.4 GB on a 24 GB machine); filling it with zeros up front made
    the scheduler resident at 3.5 GB idle and cost a second of start-up. Pages are committed on first write."""
    layers, heads, dim, tokens = 8, 4, 64, 250_000  # 1 GB of K and V in float32
    before = _resident_bytes()
    pool = TokenKVPool(tokens, layers, heads, dim, dtype, "cpu")
    grown = _resident_bytes() - before
    total = TokenKVPool.bytes_per_token(layers, heads, dim, dtype) * (tokens + 1)
    assert grown < total / 10, f"a new pool of {total >> 20} MiB made the process {grown >> 20} MiB bigger"
    for buf in pool.k_buffers + pool.v_buffers:  # still zero where never written, padding slot included
        assert buf.dtype == dtype and buf.shape == (tokens + 1, heads, dim)
        assert not buf[0].any() and not buf[tokens // 2].any() and not buf[-1].any()
    pool.k_buffers[0][1:1001] = 1.0  # writes still land
    assert pool.k_buffers[0][1:1001].eq(1.0).all()


def test_kv_pool_reuses_freed_indices_first():
    """Freed indices are handed out again before fresh ones: cycling through the whole pool (the free list
    was first in, first out) faulted in new pages for every request until all of it was resident, and
    each first touch costs more than the write itself (a soak read +126 MB per 1,000 requests)."""
    pool = TokenKVPool(1000, 1, 1, 8, torch.float32, "cpu")
    first = pool.alloc(100)
    pool.free(first)
    for _ in range(20):
        again = pool.alloc(100)
        assert set(again.tolist()) == set(first.tolist())
        pool.free(again)
    a, b = pool.alloc(30), pool.alloc(70)  # split allocations draw from the same touched indices
    assert set(a.tolist()) | set(b.tolist()) == set(first.tolist())
    pool.free(b)
    pool.free(a)
    assert pool.available == 1000 and sorted(pool.alloc(1000).tolist()) == list(range(1, 1001))

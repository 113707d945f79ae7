"""Soak: the crowd of test_crowd.py for several rounds on one engine (engine/bench/soak.py; the long
form is `python -m engine.bench --workload soak`). After every round nothing is left in any process;
open file descriptors of each process stay flat; resident memory flat within a bound in the long form
(the short one is too short to measure a slope)."""

from __future__ import annotations

import pytest

from engine.bench.soak import soak


def check(result: dict, rss_mb_per_1000: float | None) -> None:
    """rss_mb_per_1000: the bound on each process's RSS slope; None for runs too short to have one (a
    3-point slope over rounds of 40 requests is the allocator's noise: 10 MB a round reads as 250)."""
    assert result["failure_count"] == 0, "\n".join(result["failures"])
    steady = result["samples"][result["warmup_rounds"] :]
    for role in ("user", "scheduler", "detokenizer"):
        fds = [s[f"{role}_fds"] for s in steady]
        # the receiver's poll may hold one more
        assert max(fds) - min(fds) <= 2, f"{role} file descriptors {fds}"
        if rss_mb_per_1000 is not None:
            assert result["slopes"][f"{role}_rss_mb_per_1000_requests"] <= rss_mb_per_1000, (
                role,
                result["slopes"],
            )


def test_a_short_soak_leaves_nothing_behind(engine):
    # no touch_pool: it only steadies resident memory for the slope, which a run this short cannot have.
    # Prompts of at most 80 tokens: what is left behind depends on the requests, not their length, and
    # the prefill of longer ones was most of the 74 s this took on a 2-core AMD EPYC Zen 1 (test_crowd.py
    # has prompts of up to 160 tokens, make stress up to 400)
    check(
        soak(
            engine, rounds=3, per_round=40, warmup=1, seed=50, log=False, touch=False, max_prompt=80
        ),
        rss_mb_per_1000=None,
    )


@pytest.mark.stress
def test_a_long_soak_is_flat(engine):
    result = soak(engine, rounds=15, per_round=150, warmup=3, seed=60)
    check(result, rss_mb_per_1000=10.0)

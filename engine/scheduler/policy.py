"""Which waiting requests a prefill step considers first.

    lpm   longest prefix match: requests with the most tokens already in the radix cache go first, so the
          cache is used while it still holds their prefix (SGLang's default). Among requests that share
          a prefix nobody has cached yet, only the first is taken in a step; the rest wait one step and
          then find the prefix cached instead of computing it side by side.
    fcfs  first come, first served.

lpm falls back to fcfs when the queue is longer than LPM_MAX_QUEUE (matching every request each step
would cost more than the ordering saves) or when the cache is off.
"""

from __future__ import annotations

import torch

from engine.memory.radix_cache import RadixCache
from engine.scheduler.request import Req

POLICIES = ("lpm", "fcfs")
LPM_MAX_QUEUE = 128
IN_BATCH_CHECK = 32  # requests with at most this many cached tokens are checked against each other...
IN_BATCH_DEFER = 32  # ...and one sharing this many uncached tokens (or all) with an earlier one waits a step


def order_waiting(waiting: list[Req], policy: str, cache) -> list[Req]:
    """The waiting requests in the order admission should try them (deferred ones left out)."""
    if policy == "fcfs" or not cache.enabled or len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    scored = sorted(
        ((len(cache.match_prefix(r.fill_ids[: r.max_prefix()])[0]), i, r) for i, r in enumerate(waiting)),
        key=lambda item: (-item[0], item[1]),
    )
    in_batch = RadixCache(lambda _: None)  # the uncached prompts already chosen this step
    out = []
    for matched, _, req in scored:
        if matched <= IN_BATCH_CHECK:
            shared = len(in_batch.match_prefix(req.fill_ids)[0]) - matched
            uncached = req.max_prefix() - matched
            if uncached > 0 and shared >= min(IN_BATCH_DEFER, uncached):  # "all": the same prompt, as for n > 1
                continue
            in_batch.insert(req.fill_ids, torch.empty(len(req.fill_ids), dtype=torch.int64))
        out.append(req)
    return out

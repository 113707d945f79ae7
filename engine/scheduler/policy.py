"""Which waiting requests a prefill step considers first.

    lpm   longest prefix match: requests with the most tokens already in the radix cache go first, so the
          cache is used while it still holds their prefix (SGLang's default).
    fcfs  first come, first served.

Under both, requests that share a prefix nobody has cached yet are not prefilled side by side: the
first goes (or the prompt being prefilled in chunks keeps going), the others wait until it is in the
cache and then compute only what is theirs. That is also how n > 1 samples share one prefill.

With the cache off, or more than LPM_MAX_QUEUE waiting requests (matching every one each step would
cost more than it saves), the order is first come, first served with no holding back.
"""

from __future__ import annotations

import torch

from engine.memory.radix_cache import RadixCache
from engine.scheduler.request import Req

POLICIES = ("lpm", "fcfs")
LPM_MAX_QUEUE = 128
# a request sharing this many uncached tokens (or all of them) with an earlier one waits
IN_BATCH_DEFER = 32


def order_waiting(
    waiting: list[Req],
    policy: str,
    cache,
    in_progress: Req | None = None,
    free_slots: int | None = None,
) -> list[Req]:
    """The waiting requests in the order admission should try them (held-back ones left out).
    `in_progress` is a prompt part-way through chunked prefill; `free_slots` the request slots free now.
    A request that cannot start this step (its grammar compiling, a beam search short of slots) holds
    back no one: its prompt will not be computed now."""
    if not cache.enabled or len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    scored = [
        (len(cache.match_prefix(r.fill_ids[: r.max_prefix()])[0]), i, r)
        for i, r in enumerate(waiting)
    ]
    if policy == "lpm":
        scored.sort(key=lambda item: (-item[0], item[1]))
    in_batch = RadixCache(lambda _: None)  # prompts being computed now, not yet in the cache

    def add(req: Req) -> None:
        in_batch.insert(req.fill_ids, torch.empty(len(req.fill_ids), dtype=torch.int64))

    if in_progress is not None:
        add(in_progress)
    out = []
    for matched, _, req in scored:
        shared = len(in_batch.match_prefix(req.fill_ids)[0]) - matched
        uncached = req.max_prefix() - matched
        if uncached > 0 and shared >= min(IN_BATCH_DEFER, uncached):
            continue
        if startable(req, free_slots):
            add(req)
        out.append(req)
    return out


def startable(req: Req, free_slots: int | None) -> bool:
    """Whether admission could start the request now, as far as it depends on the request alone."""
    if req.grammar is not None and req.matcher is None and not req.grammar.done():
        return False
    return req.beam is None or free_slots is None or free_slots >= req.beam.width

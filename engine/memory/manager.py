"""Who owns which K/V: the one place that moves pool indices between requests, the radix cache and the
free list. The scheduler decides *what* to run; this decides nothing, it only keeps the books right.

A request's row in req_to_token holds, in order, the pool indices of its cached prefix (lent by the
tree and locked there) and of the tokens it computed itself (its own until it leaves, when they join
the tree or go back to the pool).
"""

from __future__ import annotations

import torch

from engine.memory.kv_pool import TokenKVPool
from engine.memory.radix_cache import NoPrefixCache, RadixCache
from engine.memory.req_to_token import ReqToTokenPool


class KVManager:
    def __init__(
        self, kv_pool: TokenKVPool, req_to_token: ReqToTokenPool, enable_prefix_cache: bool, device
    ) -> None:
        self.pool = kv_pool
        self.slots = req_to_token
        self.table = req_to_token.table
        cache_cls = RadixCache if enable_prefix_cache else NoPrefixCache
        self.cache = cache_cls(kv_pool.free, device)

    @property
    def headroom(self) -> int:
        """Tokens an allocation can get now: free ones plus unlocked cache the tree would give up."""
        return self.pool.available + self.cache.evictable_size

    def lend_prefix(self, req) -> int:
        """Match the request's longest cached prefix and lock it. Leaves at least one token to compute,
        since the last token's logits are what the prefill is for. Returns the prefix length."""
        indices, node = self.cache.match_prefix(req.fill_ids[: req.max_prefix()])
        self.cache.inc_lock_ref(node)
        req.prefix_indices, req.cache_node = indices, node
        return int(indices.numel())

    def unlend(self, req) -> None:
        """Give back a prefix lent by lend_prefix to a request that was not admitted after all."""
        self.cache.dec_lock_ref(req.cache_node)
        req.prefix_indices = req.cache_node = None

    def assign_slot(self, req) -> None:
        """Give the request a row of req_to_token starting with its lent prefix."""
        slot = self.slots.alloc()
        assert slot is not None, "admission checks for a free slot"
        n = req.cache_prefix_len
        if n:
            self.table[slot, :n] = req.prefix_indices
        req.slot, req.kv_len = slot, n

    def alloc(self, n: int) -> torch.Tensor:
        """n pool indices, evicting unlocked cache if the free list is short."""
        if self.pool.available < n:
            self.cache.evict(n - self.pool.available)
        loc = self.pool.alloc(n)
        if loc is None:
            raise RuntimeError(f"KV pool exhausted: {n} tokens needed, {self.pool.available} free")
        return loc

    def cache_prompt(self, req) -> None:
        """After its prefill: put the request's tokens in the tree, so requests arriving now share them."""
        if not self.cache.enabled or _private(req):
            return
        kv_len = len(req.fill_ids)
        indices, node = self.cache.cache_unfinished(
            req.fill_ids, self.table[req.slot, :kv_len], req.cache_node, req.cache_prefix_len
        )
        self.table[req.slot, :kv_len] = indices
        req.prefix_indices, req.cache_node = indices, node

    def free_request(self, req, kv_len: int, keep: bool = True) -> None:
        """The request leaves the running set (finished, retracted or failed): its K/V goes to the tree
        (keep) or back to the pool (not keep: after a failed step it may be garbage), its slot is freed.
        Its slot and fields are cleared even when the tree raises (an out-of-memory in a copy), so that a
        retracted request is admitted again afresh, not holding its old slot and lock. A request freed
        already (a second call after the first raised) has nothing left to give back."""
        if req.slot is None:
            return
        try:
            indices = self.table[req.slot, :kv_len]
            if keep and not _private(req):
                self.cache.cache_finished(
                    req.all_ids()[:kv_len], indices, req.cache_node, req.cache_prefix_len
                )
            else:
                self.cache.release(indices, req.cache_node, req.cache_prefix_len)
        finally:
            self.slots.free(req.slot)
            for slot in req.beam_slots:  # a beam search's other beams' rows
                self.slots.free(slot)
            req.beam_slots = []
            req.slot, req.kv_len, req.prefix_indices, req.cache_node = None, 0, None, None

    def stats(self) -> dict:
        cache = self.cache
        return {
            "cache_enabled": cache.enabled,
            "cache_tokens": cache.total_size,
            "cache_evictable_tokens": cache.evictable_size,
            "cache_locked_tokens": cache.protected_size,
            "cache_lock_refs": cache.lock_refs(),
            "cache_evicted_tokens": cache.evicted_tokens,
        }


def _private(req) -> bool:
    """A steered request's K/V are its own: they never join the prefix cache (engine/taps)."""
    taps = getattr(req, "taps", None)
    return taps is not None and taps.private_kv

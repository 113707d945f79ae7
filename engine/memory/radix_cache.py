"""RadixAttention prefix cache: a radix tree over token ids whose edges hold KV-pool indices.

Why: requests that share a prefix (a system prompt, few-shot examples, n samples of one prompt) reuse
the prefix's K/V instead of recomputing it. Token granularity: any prefix length can match, and a
match that ends inside an edge splits that edge so a node ends exactly where the match does.

Ownership: pool indices stored in the tree belong to the tree. A request that matched a prefix locks
the path from its node to the root (lock_ref), so eviction never frees K/V that a running request
reads. Unlocked leaves are evicted least recently used first; a parent whose last child goes becomes
a leaf and can follow. The candidates are kept in a heap as they appear (a new leaf, a leaf unlocked,
a parent left childless), checked when popped: no walk of the whole tree for each eviction, which
comes every step or two once the pool is full of cache.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: "TreeNode | None") -> None:
        self.children: dict[int, TreeNode] = {}  # keyed by the first token of the child's edge
        self.parent = parent
        self.key = key  # token ids on the edge from parent to this node
        self.value = value  # pool index of each of those tokens' K/V
        self.lock_ref = 0  # running requests whose prefix ends at or below this node
        self.last_access = 0

    def __len__(self) -> int:
        return len(self.key)


def _common_len(edge: list[int], key: list[int], pos: int) -> int:
    """How many leading tokens of `edge` equal key[pos:]; the equal case runs at C speed."""
    m = min(len(edge), len(key) - pos)
    if edge[:m] == key[pos : pos + m]:
        return m
    i = 0
    while edge[i] == key[pos + i]:
        i += 1
    return i


class RadixCache:
    enabled = True
    # stale eviction candidates allowed past twice the nodes before the heap is rebuilt
    HEAP_SLACK = 1024

    def __init__(self, free_fn: Callable[[torch.Tensor], None], device="cpu") -> None:
        self.free_fn = free_fn  # returns pool indices to the KV pool
        self.device = device
        self.evicted_tokens = 0  # since start, for stats
        self.reset()

    def reset(self) -> None:
        """Forget everything without freeing (the caller owns a fresh pool); see flush() otherwise."""
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64, device=self.device), None)
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self._clock = 0
        # eviction candidates (last access when offered, tie-break, node); stale entries are skipped when
        # popped, and one whose node was touched since goes back with its new time
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._order = itertools.count()
        self._nodes = 0  # nodes below the root, to bound the heap's stale entries

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ lookup and insertion

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The longest cached prefix of `key`: its pool indices and the node it ends at (touched for LRU)."""
        node, pos, values, now = self.root, 0, [], self._tick()
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            # after a mid-edge match the next lookup misses and ends the walk
            node, pos = (
                child,
                pos + n,
            )
        if not values:
            return self.root.value, node
        return (values[0] if len(values) == 1 else torch.cat(values)), node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add key -> value. Returns how many leading tokens were already cached: the caller's indices for
        those are duplicates of the tree's and are the caller's to free."""
        node, pos, now = self.root, 0, self._tick()
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                new = TreeNode(list(key[pos:]), value[pos:].clone(), node)
                new.last_access = now
                node.children[key[pos]] = new
                self.evictable_size += len(new)
                self._nodes += 1
                self._offer(new)
                return pos
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; the new upper node inherits its lock count and access time."""
        parent = child.parent
        mid = TreeNode(child.key[:n], child.value[:n], parent)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        child.key, child.value, child.parent = child.key[n:], child.value[n:], mid
        mid.children[child.key[0]] = child
        parent.children[mid.key[0]] = mid
        self._nodes += 1
        return mid

    # ------------------------------------------------------------------ locking

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node)
                self.protected_size += len(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node)
                self.protected_size -= len(node)
                if not node.children:
                    self._offer(node)
            node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ a request's K/V in and out

    def cache_finished(
        self, key: list[int], indices: torch.Tensor, node: TreeNode, prefix_len: int
    ) -> None:
        """A request leaves (finished or retracted): its K/V joins the tree, its duplicates are freed,
        its lock is released. `prefix_len` tokens of `indices` came from the tree at `node`. The lock is
        released whatever raises; if the insert raises, the tree took none of the indices (it adds its new
        node last), so they go back to the pool."""
        try:
            try:
                already = self.insert(key, indices)
            except BaseException:
                self.free_fn(indices[prefix_len:])
                raise
            if already > prefix_len:
                self.free_fn(indices[prefix_len:already])
        finally:
            self.dec_lock_ref(node)

    def cache_unfinished(
        self, key: list[int], indices: torch.Tensor, node: TreeNode, prefix_len: int
    ) -> tuple[torch.Tensor, TreeNode]:
        """A request's prompt is prefilled: put it in the tree now so concurrent requests can share it.
        Returns the tree's indices for `key` (the caller writes them over its own) and the node to lock."""
        already = self.insert(key, indices)
        if already > prefix_len:
            self.free_fn(indices[prefix_len:already])
        new_indices, new_node = self.match_prefix(key)
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(node)
        return new_indices, new_node

    def release(self, indices: torch.Tensor, node: TreeNode, prefix_len: int) -> None:
        """Drop a request without caching its own K/V (it may be garbage after a failed step)."""
        try:
            self.free_fn(indices[prefix_len:])
        finally:
            self.dec_lock_ref(node)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens from unlocked leaves, least recently used first (fewer if the tree
        runs out of unlocked nodes). Returns the number freed."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        freed, values = 0, []
        # self._heap, not a name for it: _offer may rebuild it
        while freed < num_tokens and self._heap:
            stamp, _, leaf = heapq.heappop(self._heap)
            if leaf.parent is None or leaf.children or leaf.lock_ref:
                continue  # evicted already, no longer a leaf, or in use: offered again when that changes
            if stamp != leaf.last_access:  # touched since it was offered: back in at its new place
                heapq.heappush(self._heap, (leaf.last_access, next(self._order), leaf))
                continue
            values.append(leaf.value)
            freed += len(leaf)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None
            self._nodes -= 1
            self.evictable_size -= len(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._offer(parent)
        if values:
            self.free_fn(torch.cat(values))
        self.evicted_tokens += freed
        return freed

    def _offer(self, node: TreeNode) -> None:
        """An unlocked leaf: a candidate for eviction. Entries go stale as nodes are locked, touched or
        grow children, and a pool that never fills never evicts: past twice the nodes (and some), the
        heap starts again from the unlocked leaves (amortized: that many offers between two rebuilds)."""
        heapq.heappush(self._heap, (node.last_access, next(self._order), node))
        if len(self._heap) > 2 * self._nodes + self.HEAP_SLACK:
            self._heap = [
                (n.last_access, next(self._order), n) for n in self._leaves() if n.lock_ref == 0
            ]
            heapq.heapify(self._heap)

    def flush(self) -> int:
        """Evict every unlocked token (what running requests hold stays). Returns the number freed."""
        return self.evict(self.evictable_size)

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def lock_refs(self) -> int:
        """Sum of lock counts below the root: 0 when no request holds a prefix (the idle state)."""
        total, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            total += node.lock_ref
            stack.extend(node.children.values())
        return total


class NoPrefixCache:
    """The same interface with caching off: nothing matches, a leaving request frees all its K/V."""

    enabled = False
    evictable_size = protected_size = total_size = evicted_tokens = 0

    def __init__(self, free_fn: Callable[[torch.Tensor], None], device="cpu") -> None:
        self.free_fn = free_fn
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64, device=device), None)

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        return self.root.value, self.root

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def cache_finished(self, key, indices: torch.Tensor, node, prefix_len: int) -> None:
        self.free_fn(indices[prefix_len:])

    def release(self, indices: torch.Tensor, node, prefix_len: int) -> None:
        self.free_fn(indices[prefix_len:])

    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> int:
        return 0

    def lock_refs(self) -> int:
        return 0

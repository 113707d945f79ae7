"""The radix tree on its own: matching, splitting, locking, LRU eviction, and the books it keeps."""

from __future__ import annotations

import torch

from engine.memory.radix_cache import RadixCache


class FreeList:
    """Stands in for the KV pool's free(): records what the tree gives back."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def __call__(self, indices: torch.Tensor) -> None:
        self.freed += indices.tolist()


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make() -> tuple[RadixCache, FreeList]:
    free = FreeList()
    return RadixCache(free), free


def test_match_returns_longest_prefix_with_its_indices():
    cache, _ = make()
    assert cache.insert([1, 2, 3, 4], idx(10, 20, 30, 40)) == 0
    indices, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert indices.tolist() == [10, 20, 30, 40] and node.key == [1, 2, 3, 4]
    assert cache.match_prefix([9, 9])[0].numel() == 0
    assert cache.total_size == cache.evictable_size == 4


def test_match_mid_edge_splits_the_node():
    cache, _ = make()
    cache.insert([1, 2, 3, 4, 5], idx(11, 12, 13, 14, 15))
    indices, node = cache.match_prefix([1, 2, 3, 9])
    assert indices.tolist() == [11, 12, 13]
    # the node ends where the match does
    assert node.key == [1, 2, 3] and node.value.tolist() == [
        11,
        12,
        13,
    ]
    (child,) = node.children.values()
    assert child.key == [4, 5] and child.value.tolist() == [14, 15] and child.parent is node
    assert cache.total_size == 5  # splitting moves tokens, it does not add any


def test_insert_reports_the_cached_part_and_branches():
    cache, _ = make()
    cache.insert([1, 2, 3, 4], idx(1, 2, 3, 4))
    # the first three tokens are cached already: the caller's indices 7, 8, 9 for them are duplicates
    assert cache.insert([1, 2, 3, 7, 8], idx(7, 8, 9, 70, 80)) == 3
    assert cache.match_prefix([1, 2, 3, 7, 8])[0].tolist() == [1, 2, 3, 70, 80]
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == [1, 2, 3, 4]
    assert cache.total_size == 6
    assert cache.insert([1, 2], idx(5, 6)) == 2  # wholly cached


def test_the_tree_copies_indices_it_keeps():
    cache, _ = make()
    row = idx(1, 2, 3)
    cache.insert([5, 6, 7], row)
    row[:] = 0  # the caller's req_to_token row is reused by the next request
    assert cache.match_prefix([5, 6, 7])[0].tolist() == [1, 2, 3]


def test_lock_protects_a_path_from_eviction():
    cache, free = make()
    cache.insert([1, 2, 3], idx(1, 2, 3))
    cache.insert([1, 2, 4, 5], idx(1, 2, 40, 50))
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    # [1, 2] and [3] locked; [4, 5] not
    assert cache.protected_size == 3 and cache.evictable_size == 2
    assert cache.evict(100) == 2
    assert sorted(free.freed) == [40, 50]
    assert cache.match_prefix([1, 2, 3])[0].tolist() == [1, 2, 3]
    cache.dec_lock_ref(node)
    assert cache.protected_size == 0 and cache.lock_refs() == 0
    assert cache.evict(100) == 3 and cache.total_size == 0


def test_nested_locks_count():
    cache, _ = make()
    cache.insert([1, 2, 3, 4], idx(1, 2, 3, 4))
    _, short = cache.match_prefix([1, 2, 9])  # splits [1 2 | 3 4]
    _, long = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(short)
    cache.inc_lock_ref(long)
    assert short.lock_ref == 2 and cache.lock_refs() == 3
    cache.dec_lock_ref(long)
    assert cache.evictable_size == 2 and cache.protected_size == 2
    cache.dec_lock_ref(short)
    assert cache.lock_refs() == 0 and cache.evictable_size == 4


def test_eviction_is_least_recently_used_first():
    cache, free = make()
    cache.insert([1, 1], idx(11, 12))
    cache.insert([2, 2], idx(21, 22))
    cache.insert([3, 3], idx(31, 32))
    cache.match_prefix([1, 1])  # [1 1] is now the most recently used
    assert cache.evict(2) == 2 and free.freed == [21, 22]
    assert cache.evict(2) == 2 and free.freed[2:] == [31, 32]
    assert cache.match_prefix([1, 1])[0].tolist() == [11, 12]


def test_match_after_eviction_finds_the_surviving_prefix():
    cache, free = make()
    cache.insert([1, 2, 3, 4], idx(1, 2, 3, 4))
    cache.insert([1, 2, 5, 6], idx(1, 2, 5, 6))
    cache.match_prefix([1, 2, 3, 4])  # touch the first branch: [5, 6] is the LRU leaf
    assert cache.evict(1) == 2 and sorted(free.freed) == [5, 6]
    assert cache.match_prefix([1, 2, 5, 6])[0].tolist() == [1, 2]
    # evicting a parent's last child makes the parent a leaf that can go next
    assert cache.evict(3) == 4 and cache.total_size == 0
    assert cache.match_prefix([1, 2, 3, 4])[0].numel() == 0


def test_cache_finished_frees_duplicates_and_unlocks():
    cache, free = make()
    cache.insert([1, 2, 3], idx(1, 2, 3))
    prefix, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    # the request computed [3, 4, 5] itself (indices 30, 40, 50) while another request inserted [3]
    row = torch.cat([prefix, idx(30, 40, 50)])
    cache.cache_finished([1, 2, 3, 4, 5], row, node, prefix_len=2)
    assert free.freed == [30]  # its copy of token 3 is a duplicate of the tree's
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [1, 2, 3, 40, 50]
    assert cache.lock_refs() == 0 and cache.total_size == 5


def test_cache_unfinished_moves_the_lock_to_the_longer_prefix():
    cache, free = make()
    prefix, node = cache.match_prefix([7, 8, 9])
    cache.inc_lock_ref(node)
    indices, new_node = cache.cache_unfinished([7, 8, 9], idx(70, 80, 90), node, prefix_len=0)
    assert indices.tolist() == [70, 80, 90] and new_node.lock_ref == 1 and free.freed == []
    assert cache.protected_size == 3 and cache.evict(10) == 0
    cache.dec_lock_ref(new_node)
    assert cache.flush() == 3 and sorted(free.freed) == [70, 80, 90]


def test_eviction_takes_the_least_recently_used_leaf_without_walking_the_tree(monkeypatch):
    """Each eviction walked the whole tree and ordered every unlocked leaf, to free a leaf or two: with
    the pool full of cache, that is every decode step or two (27 ms for 20,000 cached sequences in a
    reviewer's run). Candidates are kept as they appear now. Random inserts, matches, locks and
    unlocks: each evict(1) frees a leaf of the smallest last access among the unlocked leaves, and
    after the first, no eviction walks the tree."""
    import random

    cache, free = make()
    rnd, locked, nxt = random.Random(0), [], 0
    walks = []
    real_leaves = cache._leaves
    monkeypatch.setattr(cache, "_leaves", lambda: walks.append(1) or real_leaves())
    for op in range(3000):
        r = rnd.random()
        if r < 0.4:
            key = [rnd.randrange(4) for _ in range(rnd.randrange(1, 8))]
            already = cache.insert(key, torch.arange(nxt, nxt + len(key)))
            free(torch.arange(nxt, nxt + already))  # the caller's duplicates
            nxt += len(key)
        elif r < 0.6:
            _, node = cache.match_prefix([rnd.randrange(4) for _ in range(rnd.randrange(1, 8))])
            if node is not cache.root and rnd.random() < 0.5:
                cache.inc_lock_ref(node)
                locked.append(node)
        elif r < 0.75 and locked:
            cache.dec_lock_ref(locked.pop(rnd.randrange(len(locked))))
        elif cache.evictable_size:
            leaves = [n for n in real_leaves() if n.lock_ref == 0]
            oldest = min(n.last_access for n in leaves)
            cache.evict(1)
            gone = [
                n for n in leaves if n.parent is None or n.parent.children.get(n.key[0]) is not n
            ]
            assert len(gone) == 1 and gone[0].last_access == oldest, op
    assert walks == [], "an eviction walked the tree"
    for node in locked:
        cache.dec_lock_ref(node)
    cache.flush()
    assert cache.total_size == 0 and sorted(free.freed) == list(range(nxt))


def test_the_eviction_heap_stays_bounded_when_nothing_is_evicted():
    """Every new leaf and every unlock offers a heap entry, and only an eviction dropped stale ones: a
    server whose pool never fills (short or repeated prompts) grew the heap by an entry a request for
    good (100,000 requests, one node: 100,001 entries in a reviewer's run)."""
    cache, _ = make()
    key = [1, 2, 3, 4]
    cache.insert(key, idx(0, 1, 2, 3))
    for _ in range(5000):  # a request matching the whole prompt, locking it, then leaving
        _, node = cache.match_prefix(key)
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(node)
    assert len(cache._heap) <= 2 * cache._nodes + 1025
    assert cache.evict(4) == 4 and cache.total_size == 0


def test_evictions_free_what_they_are_asked_while_the_heap_is_rebuilt_often(monkeypatch):
    """With the candidates' heap rebuilt at almost every offer (a slack of 2), in the middle of
    evictions too: each evict(n) frees at least min(n, the evictable tokens), and a flush frees all."""
    import random

    monkeypatch.setattr(RadixCache, "HEAP_SLACK", 2)
    for seed in range(100):
        rnd = random.Random(seed)
        cache, free = make()
        locked, nxt = [], 0
        for _ in range(300):
            r = rnd.random()
            if r < 0.45:
                key = [rnd.randrange(3) for _ in range(rnd.randrange(1, 10))]
                already = cache.insert(key, torch.arange(nxt, nxt + len(key)))
                free(torch.arange(nxt, nxt + already))
                nxt += len(key)
            elif r < 0.65:
                _, node = cache.match_prefix(
                    [rnd.randrange(3) for _ in range(rnd.randrange(1, 10))]
                )
                if node is not cache.root:
                    cache.inc_lock_ref(node)
                    locked.append(node)
            elif r < 0.8 and locked:
                cache.dec_lock_ref(locked.pop(rnd.randrange(len(locked))))
            else:
                before, n = cache.evictable_size, rnd.randrange(1, 20)
                assert cache.evict(n) >= min(n, before), seed
        for node in locked:
            cache.dec_lock_ref(node)
        cache.flush()
        assert cache.total_size == 0 and sorted(free.freed) == list(range(nxt)), seed

"""A seeded, shuffled workload of prefix groups, as a chat service sees one: each group is many
requests sharing a long system text and differing in a short question. It tells a router that sends
a group to one replica (cache-aware) from one that spreads it (round robin): the engines report how
much of the prompts their prefix caches served. The scale benchmark and tests/test_gateway.py run it.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# common words that the byte-level BPE vocabularies keep as one token each, with their space
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by not "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over"
).split()


@dataclass(frozen=True)
class Request:
    group: int
    prompt: str


def prefix_groups(groups: int, per_group: int, prefix_words: int, seed: int = 0) -> list[Request]:
    """groups x per_group requests, shuffled; each group's prompts start with the same prefix_words
    words (about as many tokens) and end with a question of their own."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(groups)]
    requests = [
        Request(g, f"{prefixes[g]}\nQuestion {g}.{i}: which word comes next?")
        for g in range(groups)
        for i in range(per_group)
    ]
    rng.shuffle(requests)
    return requests


def run_completions(
    client, model: str, requests: list[Request], concurrency: int, max_tokens: int
) -> list:
    """Send every request through the `openai` client, `concurrency` at a time (greedy, short
    answers); returns the responses in the workload's order."""

    def one(request: Request):
        return client.completions.create(
            model=model, prompt=request.prompt, max_tokens=max_tokens, temperature=0
        )

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, requests))


def hit_rate(before: list[dict], after: list[dict]) -> float:
    """The prefix-cache hit rate over a run, from every replica's /stats before and after it:
    prompt tokens the caches served over prompt tokens admitted."""
    hit = sum(
        a["prompt_cache_hit_tokens"] - b["prompt_cache_hit_tokens"] for b, a in zip(before, after)
    )
    total = sum(a["prompt_tokens"] - b["prompt_tokens"] for b, a in zip(before, after))
    return hit / total if total else 0.0

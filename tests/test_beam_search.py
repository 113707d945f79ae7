"""Beam search in the scheduler: token parity with transformers' beam search in float32, and the
bookkeeping around it (memory bound, mixing with ordinary requests, refusals, aborts, failures)."""

from __future__ import annotations

import threading

import pytest

from conftest import PROMPTS


def _prompt_ids(tokenizer, i: int) -> list[int]:
    return tokenizer.encode(PROMPTS[i])


def hf_beam_search(
    model,
    ids: list[int],
    k: int,
    n: int,
    r: int = 1,
    length_penalty: float = 1.0,
    early_stopping=False,
    processors=(),
    **kwargs,
) -> list[tuple[list[int], float]]:
    """transformers' generate(num_beams=k): the r best (generated ids, sequence score), no padding inside."""
    import torch
    from transformers import LogitsProcessorList

    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            num_beams=k,
            num_return_sequences=r,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            do_sample=False,
            pad_token_id=eos,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList(processors),
            **kwargs,
        )
    seqs = out.sequences[:, len(ids) :].tolist()
    # transformers runs greedy search: the score from its raw logits, as beam search keeps it
    if k == 1:
        steps = torch.stack([torch.log_softmax(x[0], -1) for x in out.logits])
        total = float(steps.gather(1, torch.tensor(seqs[0])[: len(steps), None]).sum())
        return [(seqs[0], total / len(steps) ** length_penalty)]
    return [(s, float(score)) for s, score in zip(seqs, out.sequences_scores.tolist())]


def _same(ours: list[dict], ref: list[tuple[list[int], float]], eos: int) -> None:
    """The same hypotheses, token for token, with the same scores to float32 rounding: within 1e-4, or 1e-5 of
    the score. Our linear layers may run another kernel than transformers' (oneDNN's or ours), summing in
    another order, and a score scales its summed logprobs by len ** -penalty, which can scale that gap."""
    assert len(ours) == len(ref)
    for h, (ids, score) in zip(ours, ref):
        padded = h["output_ids"] + [eos] * (len(ids) - len(h["output_ids"]))
        assert padded == ids, (h["output_ids"], ids)
        assert h["score"] == pytest.approx(score, rel=1e-5, abs=1e-4)


class ForTransformers:
    """One of our custom logit processors, given to transformers through `logits_processor`."""

    def __init__(self, name: str, params: dict, prompt_len: int) -> None:
        from engine.sampling.processors import get_logit_processor

        self.proc = get_logit_processor(name)()
        self.params = params
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        import torch

        from engine.sampling.processors import ProcessorBatch

        out = input_ids[:, self.prompt_len :]
        rows = out.shape[0]
        batch = ProcessorBatch(
            [self.params] * rows, out.tolist(), torch.full((rows,), out.shape[1]), list(range(rows))
        )
        return self.proc(scores, batch)


CASES = [  # (prompt, K, N, R, length_penalty, early_stopping, extra sampling parameters)
    (0, 1, 12, 1, 1.0, False, {}),
    (1, 2, 12, 2, 1.0, False, {}),
    (2, 4, 16, 3, 1.0, True, {}),
    (3, 8, 12, 4, 1.0, False, {}),
    (0, 4, 24, 2, 0.6, "never", {}),
    (5, 4, 12, 2, 2.0, False, {}),
    (6, 4, 16, 2, 1.0, False, {"repetition_penalty": 1.3}),
    (4, 3, 12, 3, -0.5, True, {"min_new_tokens": 4}),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[f"K{c[1]}-N{c[2]}-R{c[3]}-lp{c[4]}-es{c[5]}-{'-'.join(c[6]) or 'plain'}" for c in CASES],
)
def test_matches_transformers(engine, hf_model, tokenizer, case):
    prompt, k, n, r, lp, es, extra = case
    ids = _prompt_ids(tokenizer, prompt)
    ours = engine.beam_search(
        input_ids=ids,
        beam_width=k,
        max_new_tokens=n,
        num_return_sequences=r,
        length_penalty=lp,
        early_stopping=es,
        **extra,
    )
    hf_extra = dict(extra)
    if "min_new_tokens" in hf_extra:
        hf_extra["min_new_tokens"] = extra["min_new_tokens"]
    ref = hf_beam_search(hf_model, ids, k, n, r, lp, es, **hf_extra)
    _same(ours["hypotheses"], ref, tokenizer.eos_token_id)
    assert ours["meta_info"]["beam_width"] == k and ours["meta_info"]["steps"] >= 1
    assert all(
        h["text"] == tokenizer.decode(h["output_ids"], skip_special_tokens=True)
        for h in ours["hypotheses"]
    )


@pytest.mark.parametrize(
    "name,params",
    [
        ("disallowed_tokens", {"token_ids": [7042, 30, 28]}),
        ("force_token_after", {"token_id": 2, "after": 6}),
    ],
)
def test_custom_logit_processor_matches_transformers(engine, hf_model, tokenizer, name, params):
    ids = _prompt_ids(tokenizer, 0)
    ours = engine.beam_search(
        input_ids=ids,
        beam_width=4,
        max_new_tokens=12,
        num_return_sequences=2,
        custom_logit_processor=name,
        custom_params=params,
    )
    ref = hf_beam_search(
        hf_model, ids, 4, 12, 2, processors=[ForTransformers(name, params, len(ids))]
    )
    _same(ours["hypotheses"], ref, tokenizer.eos_token_id)
    if name == "disallowed_tokens":
        assert not set(params["token_ids"]) & {
            t for h in ours["hypotheses"] for t in h["output_ids"]
        }


def _idle(engine) -> dict:
    stats = engine.get_stats()
    assert (
        stats["running"]
        == stats["waiting"]
        == stats["beam_searches"]
        == stats["beam_kv_tokens"]
        == 0
    ), stats
    assert stats["cache_lock_refs"] == 0 and stats["free_slots"] == stats["max_running_requests"], (
        stats
    )
    assert stats["free_tokens"] + stats["cache_tokens"] == stats["max_total_tokens"], stats
    return stats


SEARCHES = [(0, 4, 16), (2, 8, 12), (5, 2, 20)]  # (prompt, K, N)


def test_concurrent_searches_and_ordinary_requests_give_the_same_results_as_alone(
    engine, tokenizer
):
    alone = [
        engine.beam_search(PROMPTS[p], beam_width=k, max_new_tokens=n, num_return_sequences=2)[
            "hypotheses"
        ]
        for p, k, n in SEARCHES
    ]
    greedy = {"max_new_tokens": 24, "temperature": 0}
    plain_alone = [engine.generate(PROMPTS[i], greedy)["output_ids"] for i in (1, 3)]
    engine.flush_cache()  # nothing shared from the runs alone
    results: dict = {}

    def search(i: int, p: int, k: int, n: int) -> None:
        results[("beam", i)] = engine.beam_search(
            PROMPTS[p], beam_width=k, max_new_tokens=n, num_return_sequences=2
        )

    def plain(i: int, p: int) -> None:
        results[("plain", i)] = engine.generate(PROMPTS[p], greedy)

    threads = [threading.Thread(target=search, args=(i, *s)) for i, s in enumerate(SEARCHES)]
    threads += [threading.Thread(target=plain, args=(i, p)) for i, p in enumerate((1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(SEARCHES)):
        assert [h["output_ids"] for h in results[("beam", i)]["hypotheses"]] == [
            h["output_ids"] for h in alone[i]
        ]
    for i in range(2):
        assert results[("plain", i)]["output_ids"] == plain_alone[i]
    # a batch call: one search per prompt, the same results again
    batch = engine.beam_search(
        [PROMPTS[p] for p, _, _ in SEARCHES[:1]] * 2,
        beam_width=4,
        max_new_tokens=16,
        num_return_sequences=2,
    )
    assert [[h["output_ids"] for h in b["hypotheses"]] for b in batch] == [
        [h["output_ids"] for h in alone[0]]
    ] * 2
    _idle(engine)


def test_memory_bound_from_pool_stats(engine, tokenizer):
    """K beams over a P-token prompt hold at most P + K x N pool tokens: the prompt once (in the cache),
    one token per beam per decode step; no K/V is ever copied."""
    engine.flush_cache()
    k, n = 8, 48
    ids = _prompt_ids(tokenizer, 7)
    samples: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            samples.append(engine.get_stats())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = engine.beam_search(input_ids=ids, beam_width=k, max_new_tokens=n, ignore_eos=True)
    finally:
        done.set()
        watcher.join()
    assert out["meta_info"]["steps"] == n  # no stop token: every beam runs to max_new_tokens
    running = [s for s in samples if s["beam_searches"] == 1]
    assert running, "the watcher never saw the search running"
    for s in running:
        used = s["max_total_tokens"] - s["free_tokens"]
        # the prompt in the cache, beams' tokens
        assert used == s["cache_tokens"] + s["beam_kv_tokens"], s
        assert s["cache_tokens"] <= len(ids) and s["beam_kv_tokens"] <= k * (n - 1), s
        assert used <= len(ids) + k * n
    stats = _idle(engine)
    # it did hold one token per beam per decode step
    assert stats["beam_kv_peak_tokens"] >= k * (n - 1)


def test_refused_arguments_name_themselves_before_anything_is_queued(engine):
    before = engine.get_stats()
    cases = {
        "temperature": dict(temperature=0.7),
        "top_p": dict(top_p=0.9),
        "n": dict(n=2),
        "seed": dict(seed=1),
        "stop": dict(stop=["."]),
        "stream": dict(stream=True),
        "return_logprob": dict(return_logprob=True),
        "num_return_sequences": dict(num_return_sequences=5),
        "beam_width": dict(beam_width=0),
        "early_stopping": dict(early_stopping="sometimes"),
        "length_penalty": dict(length_penalty=float("nan")),
        "max_total_tokens": dict(beam_width=256, max_new_tokens=200),
        "unknown": dict(best_of=3),
        "max_new_tokens": dict(max_new_tokens=0),
    }
    for name, kwargs in cases.items():
        kwargs = {"beam_width": 4, **kwargs}
        with pytest.raises(ValueError, match=name if name != "unknown" else "best_of"):
            engine.beam_search(PROMPTS[0], **kwargs)
    after = engine.get_stats()
    assert (
        after["aborted_requests"] == before["aborted_requests"]
        and after["prompt_tokens"] == before["prompt_tokens"]
    )


def test_abort_frees_every_beam(engine):
    results = {}

    def run() -> None:
        results["out"] = engine.beam_search(
            PROMPTS[7], beam_width=8, max_new_tokens=400, ignore_eos=True, rid="long-beam"
        )

    t = threading.Thread(target=run)
    t.start()
    import time

    deadline = time.time() + 60
    while engine.get_stats()["beam_kv_tokens"] < 64 and time.time() < deadline:
        time.sleep(0.05)
    engine.abort("long-beam")
    t.join(60)
    assert not t.is_alive()
    out = results["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["hypotheses"] == []
    _idle(engine)


def test_async_form_gives_the_same_result(engine):
    import asyncio

    sync = engine.beam_search(PROMPTS[4], beam_width=3, max_new_tokens=10, num_return_sequences=3)
    both = asyncio.run(_two_async(engine))
    assert [h["output_ids"] for h in both[0]["hypotheses"]] == [
        h["output_ids"] for h in sync["hypotheses"]
    ]
    assert len(both[1]) == 2 and all(len(r["hypotheses"]) == 1 for r in both[1])


async def _two_async(engine):
    import asyncio

    return await asyncio.gather(
        engine.async_beam_search(
            PROMPTS[4], beam_width=3, max_new_tokens=10, num_return_sequences=3
        ),
        engine.async_beam_search(
            messages=[[{"role": "user", "content": "Hi"}]] * 2, beam_width=2, max_new_tokens=6
        ),
    )

"""engine/beam_search/selection.py alone (no engine): the fast candidate search gives the candidates
one top-k over K x V gives (transformers' way), and a search's KV reservation is what it takes."""

from __future__ import annotations

import pytest
import torch

from engine.beam_search.batch import BeamGroup
from engine.beam_search.selection import PUSH_DOWN, BeamSelection


def _flat(sel: BeamSelection, logprobs: torch.Tensor):
    k, vocab = sel.width, logprobs.shape[1]
    total = (logprobs.expand(k, -1) + sel.scores[:, None]).reshape(-1)
    scores, index = torch.topk(total, sel.keep)
    return scores, index // vocab, index % vocab


def _same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert sorted(zip(a[1].tolist(), a[2].tolist())) == sorted(zip(b[1].tolist(), b[2].tolist()))


def test_two_top_ks_give_the_candidates_of_one():
    gen = torch.Generator().manual_seed(0)
    for k in (2, 4, 8, 32):
        sel = BeamSelection(k, 8, (2,))
        sel.scores = torch.randn(k, generator=gen) * 3
        logprobs = torch.log_softmax(torch.randn(k, 1000, generator=gen), -1)
        _same(sel._best_candidates(logprobs), _flat(sel, logprobs))


def test_ties_at_the_cut_and_pushed_down_rows_fall_back_to_one_top_k():
    sel = BeamSelection(4, 8, (2,))
    sel.scores = torch.tensor([0.0, PUSH_DOWN, PUSH_DOWN, PUSH_DOWN])
    logprobs = torch.full((4, 50), -5.0)  # every candidate ties
    logprobs[0, :3] = torch.tensor([-0.1, -0.2, -0.3])
    got = sel._best_candidates(logprobs)
    assert torch.equal(got[0], _flat(sel, logprobs)[0])


def test_the_start_reads_the_prompts_row_unless_other_beams_would_count():
    sel = BeamSelection(4, 8, (2,))
    row = torch.log_softmax(torch.randn(1, 1000, generator=torch.Generator().manual_seed(1)), -1)
    fast = sel._best_candidates(row)
    assert fast[1].eq(0).all()
    _same(fast, _flat(sel, row))
    # a processor's finite mask leaves 2 tokens, fewer than keep = 8
    masked = torch.full((1, 1000), -1e10)
    masked[0, 5], masked[0, 9] = -0.5, -1.5
    got = sel._best_candidates(masked)
    # the other beams' pushed-down tokens come next
    assert torch.equal(got[0], _flat(sel, masked)[0])
    assert set(got[1].tolist()) != {0}


def test_a_searchs_reservation_is_what_its_decode_steps_take():
    k, n = 4, 9
    sel = BeamSelection(k, n, (), device="cpu")
    group = BeamGroup(None, sel, torch.zeros(k, dtype=torch.int64))
    gen = torch.Generator().manual_seed(2)
    # the start, from the prefill
    sel.step(torch.log_softmax(torch.randn(1, 100, generator=gen), -1))
    taken = 0
    while not sel.done:
        assert group.remaining_tokens() == k * (n - 1) - taken  # what is still to come, exactly
        taken += k  # a decode step: one pool token per beam
        sel.step(torch.log_softmax(torch.randn(k, 100, generator=gen), -1))
    assert taken == k * (n - 1) and group.remaining_tokens() == 0


@pytest.mark.parametrize("regex, k, answers", [("(yes|no)", 4, {"yes", "no"}), ("a", 2, {"a"})])
def test_a_constrained_search_short_of_candidates_never_fills_a_terminated_matcher(
    regex, k, answers
):
    """A grammar that leaves fewer continuations than beams: the beams kept to fill the width carry a stop
    token at a pushed-down score. Their matchers must not accept it (a terminated matcher has no next mask:
    xgrammar's fill raises, and the step failed every request in the batch); they keep their parent's state,
    as a beam at -inf does, and count as -inf from then on: their continuations would make hypotheses with a
    stop token inside ("a</s></s>"), which filled the results of a grammar with fewer answers than beams."""
    import xgrammar as xgr

    from engine.beam_search.batch import advance_matchers

    vocab = ["y", "ye", "yes", "n", "no", "e", "es", "s", "o", "</s>", "x", "a"]
    eos = vocab.index("</s>")
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[eos])
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex)
    fill = xgr.BatchGrammarMatcher(max_threads=1)

    def masked(logprobs: torch.Tensor, matchers: list) -> torch.Tensor:  # what Grammars.mask does
        bitmask = xgr.allocate_token_bitmask(len(matchers), len(vocab))
        fill.batch_fill_next_token_bitmask(matchers, bitmask, list(range(len(matchers))))
        xgr.apply_token_bitmask_inplace(
            logprobs, bitmask, vocab_size=len(vocab), indices=list(range(len(matchers)))
        )
        return logprobs

    gen = torch.Generator().manual_seed(0)
    sel = BeamSelection(k, 5, (eos,), 1.0, False)
    root = xgr.GrammarMatcher(grammar)
    _, tokens = sel.step(
        masked(torch.log_softmax(torch.randn(1, len(vocab), generator=gen), -1), [root])
    )
    matchers = advance_matchers([root], [0] * k, tokens.tolist(), sel)
    short = False
    while not sel.done:
        parents, tokens = sel.step(
            masked(torch.log_softmax(torch.randn(k, len(vocab), generator=gen), -1), matchers)
        )
        short |= bool((sel.scores <= PUSH_DOWN / 2).any())
        matchers = advance_matchers(matchers, parents.tolist(), tokens.tolist(), sel)
        assert not any(m.is_terminated() for m in matchers)
    assert short  # the case this test is for happened
    found = sel.results(k)  # finished ones only: fewer than k here
    assert all(h.stopped for h in found)
    texts = {"".join(vocab[t] for t in h.output_ids[:-1]) for h in found}
    assert texts and texts <= answers and all(h.output_ids[-1] == eos for h in found), texts
    # a kept beam's continuations never make a hypothesis with a stop token inside
    for h in sel.results(k):
        assert eos not in h.output_ids[:-1], [vocab[t] for t in h.output_ids]


def test_a_start_with_fewer_allowed_tokens_than_beams_returns_no_placeholder_hypotheses():
    """A grammar that allows fewer first tokens than beams: the start expands over every beam, the
    prompt's copies at -1e9, and their candidates that finished (max_new_tokens 1, or a stop token)
    were returned as hypotheses scored -1e9, duplicates of real ones. docs/structured_output.md
    promises fewer hypotheses then, not fake ones."""
    for max_new, allowed in ((1, [7]), (1, [7, 9]), (3, [2])):
        sel = BeamSelection(4, max_new, (2,))
        logprobs = torch.full((1, 50), float("-inf"))
        logprobs[0, allowed] = torch.log_softmax(
            torch.arange(len(allowed), dtype=torch.float32), -1
        )
        sel.step(logprobs)
        while not sel.done:
            sel.step(
                torch.log_softmax(
                    torch.randn(4, 50, generator=torch.Generator().manual_seed(sel.steps)), -1
                )
            )
        got = sel.results(4)
        assert all(h.logprob > PUSH_DOWN / 2 for h in got), [(h.output_ids, h.logprob) for h in got]
        if max_new == 1:
            assert sorted(h.output_ids[0] for h in got) == sorted(allowed)


def test_more_stop_ids_than_candidates_are_clamped_to_the_candidates():
    """keep = (1 + stop ids) x K candidates: with a stop list as long as the vocabulary it passed the K x V
    there are, and topk raised inside the step (failing every request in it)."""
    vocab = 50
    for k in (1, 3):
        gen = torch.Generator().manual_seed(k)
        sel = BeamSelection(k, 4, tuple(range(vocab)))  # every token stops
        sel.step(torch.log_softmax(torch.randn(1, vocab, generator=gen), -1))
        assert sel.done and len(sel.results(k)) == k


def test_a_steps_memory_does_not_grow_with_stop_ids_times_max_new_tokens():
    """Every one of the keep = (1 + stop ids) x K candidates got a copy of its parent's tokens, [keep,
    max_new_tokens] int64 (1.5 GB for one K=1 search with 49,151 stop ids and 2,000 new tokens). Only the
    candidates chosen (K live beams, K finished) need one: a step allocates no more than the scores do."""
    from torch.profiler import ProfilerActivity, profile

    vocab = 49152
    sel = BeamSelection(1, 4096, tuple(range(1, 1025)))
    logprobs = torch.log_softmax(
        torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)), -1
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sel.step(logprobs)
        sel.step(logprobs)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 2 * vocab * 4, f"a step allocated {largest:,} bytes at once"

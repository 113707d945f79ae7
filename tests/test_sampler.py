"""The sampler on its own: each logit transformation against transformers' logits processors on the
same logits (where transformers has one) or a hand-computed reference; stop strings across pieces."""

from __future__ import annotations

import pytest
import torch

from engine.detokenizer.stop_strings import StopMatcher
from engine.sampling.batch_params import SamplingTensors
from engine.sampling.processors import ProcessorSet
from engine.sampling.sampler import apply_penalties, sample, top_k_top_p
from engine.sampling.stop_table import StopTable
from engine.sampling_params import SamplingParams

V = 64


def tensors(
    params: list[SamplingParams], prompts=None, outputs=None, logprob=None
) -> SamplingTensors:
    n = len(params)
    return SamplingTensors.build(
        params,
        V,
        "cpu",
        prompts or [[1, 2, 3]] * n,
        outputs or [[]] * n,
        logprob or [(False, 0)] * n,
    )


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 5, 9], [2, 2, 7, 30], [40]]
    outputs = [[11, 5], [], [40, 41, 41]]
    params = [SamplingParams(repetition_penalty=p) for p in (1.3, 0.7, 2.0)]
    st = tensors(params, prompts, outputs)
    ours = apply_penalties(logits.clone(), st)
    for row, p in enumerate(params):
        ids = torch.tensor([prompts[row] + outputs[row]])
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            ids, logits[row : row + 1].clone()
        )
        torch.testing.assert_close(ours[row], ref[0])


def test_frequency_and_presence_penalties_follow_openai():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    outputs = [[3, 3, 3, 8], [8]]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(presence_penalty=-1.0),
    ]
    st = tensors(params, [[3, 4], [8, 9]], outputs)
    ours = apply_penalties(logits.clone(), st)
    ref = logits.clone()
    for row, (out, p) in enumerate(zip(outputs, params)):
        for token in set(out):  # prompt tokens are not penalized by these two
            ref[row, token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
    torch.testing.assert_close(ours, ref)


def test_penalty_counts_follow_sampled_tokens():
    st = tensors([SamplingParams(frequency_penalty=1.0, temperature=0)])
    logits = torch.zeros(1, V)
    logits[0, 7] = 5.0
    first = sample(
        logits.clone(), st, torch.tensor([0]), torch.full((1, 1), -1), [[]], ProcessorSet()
    )
    assert first.next_ids.tolist() == [7] and st.counts[0, 7] == 1
    # each 7 costs it 1.0: after five of them it ties with the rest and loses the argmax to token 0
    picks = [
        sample(
            logits.clone(), st, torch.tensor([0]), torch.full((1, 1), -1), [[]], ProcessorSet()
        ).next_ids.item()
        for _ in range(5)
    ]
    assert picks == [7, 7, 7, 7, 0]
    assert st.counts[0, 7] == 5 and st.counts[0, 0] == 1


def test_min_p_matches_transformers():
    from transformers.generation.logits_process import MinPLogitsWarper

    torch.manual_seed(2)
    logits = torch.randn(4, V) * 2
    min_ps = [0.05, 0.2, 0.5, 0.9]
    for row, min_p in enumerate(min_ps):
        ref = MinPLogitsWarper(min_p)(None, logits[row : row + 1].clone())[0]
        probs = torch.softmax(logits[row], -1)
        kept = probs >= min_p * probs.max()
        assert torch.equal(kept, torch.isfinite(ref)), min_p
    # and the sampler only ever draws kept tokens
    params = [SamplingParams(min_p=m) for m in min_ps]
    st = tensors(params)
    for _ in range(50):
        ids = sample(
            logits.clone(),
            st,
            torch.zeros(4, dtype=torch.int64),
            torch.full((4, 1), -1),
            [[]] * 4,
            ProcessorSet(),
        ).next_ids
        probs = torch.softmax(logits, -1)
        chosen = probs.gather(1, ids[:, None]).squeeze(1)
        assert bool((chosen >= torch.tensor(min_ps) * probs.max(-1).values).all())


def test_min_new_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS is by far the most likely
    st = tensors([SamplingParams(min_new_tokens=3, temperature=0)] * 2)
    logits[0, 5] = 9.0  # then row 0's second stop token
    stops = StopTable.build([[2, 5], [2]], "cpu")
    out = sample(logits.clone(), st, torch.tensor([1, 3]), stops, [[]] * 2, ProcessorSet())
    assert out.next_ids.tolist()[1] == 2  # the second row has made its 3 tokens
    assert out.next_ids.tolist()[0] not in (2, 5)


def test_the_stop_check_costs_the_stop_ids_there_are():
    """Every running row's stop ids were padded to the widest list: one request with 1,024 stop ids made
    the table [batch, 1,025] and every decode step compared all of it, its neighbours' rows included.
    Each row now holds its own ids only."""
    from engine.scheduler.batch import RunningBatch
    from engine.scheduler.request import Req

    wide = Req("wide", [1, 2], SamplingParams(stop_token_ids=tuple(range(10, 1034))), (2,))
    plain = [Req(f"r{i}", [1, 2], SamplingParams(), (2,)) for i in range(7)]
    for slot, req in enumerate([wide, *plain]):
        req.slot = slot
    batch = RunningBatch([wide, *plain], V * 1000, "cpu")
    assert batch.stop_table.numel() == 1025 + 7


def test_the_stop_table_follows_its_rows_through_merge_and_filter():
    a, b = StopTable.build([[2], []], "cpu"), StopTable.build([[5, 9, 2], [7]], "cpu")
    both = a.cat(b)
    assert both.hits(torch.tensor([2, 2, 9, 8])).tolist() == [True, False, True, False]
    kept = both.filter(torch.tensor([False, True, True, True]), 3)
    assert kept.numel() == 4 and kept.hits(torch.tensor([2, 5, 7])).tolist() == [False, True, True]
    assert kept.hits(torch.tensor([0, 0, 0])).tolist() == [False] * 3
    assert StopTable.build([], "cpu").cat(kept).hits(torch.tensor([1, 1, 7])).tolist() == [
        False,
        False,
        True,
    ]


def test_logit_bias_and_logprobs_from_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    st = tensors(
        [SamplingParams(temperature=0, logit_bias=((9, 100.0),)), SamplingParams(temperature=0)],
        logprob=[(True, 3), (True, 0)],
    )
    out = sample(
        logits.clone(),
        st,
        torch.zeros(2, dtype=torch.int64),
        torch.full((2, 1), -1),
        [[]] * 2,
        ProcessorSet(),
    )
    assert out.next_ids.tolist() == [9, int(logits[1].argmax())]
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs[0], raw[0].topk(3).values)


def test_seeded_rows_ignore_their_neighbours():
    torch.manual_seed(4)
    logits = torch.randn(3, V)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = tensors([seeded])
    mixed = tensors([SamplingParams(temperature=0.7), seeded, SamplingParams(temperature=0)])
    for step in range(20):
        lens = torch.tensor([step])
        a = sample(
            logits[1:2].clone(), alone, lens, torch.full((1, 1), -1), [[]], ProcessorSet()
        ).next_ids
        b = sample(
            logits.clone(), mixed, lens.repeat(3), torch.full((3, 1), -1), [[]] * 3, ProcessorSet()
        ).next_ids
        assert a.item() == b[1].item()


def test_top_p_one_keeps_every_token_beside_a_row_that_cuts():
    """top_p = 1.0 is off, also when a neighbour's top_k or top_p sends the batch through the sort: a float32
    running sum over 49,152 probabilities passes 1.0 before the tail, which must not be cut."""
    torch.manual_seed(6)
    probs = torch.softmax(torch.randn(50, 49152) * 3, dim=-1)
    top_k = torch.full((50,), 49152, dtype=torch.int64)
    top_k[0] = 5  # the neighbour that sends the batch through the sort
    kept = top_k_top_p(probs, top_k, torch.ones(50))
    assert torch.equal(kept[1:], probs[1:])
    assert int((kept[0] > 0).sum()) == 5


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    probs = torch.tensor(
        [[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125], [0.5, 0.25, 0.125, 0.125]]
    )
    # sums exact in float32: the first two reach 0.5 and 0.75
    top_p = torch.tensor([0.5, 0.75, 0.76])
    kept = top_k_top_p(probs, torch.full((3,), 4, dtype=torch.int64), top_p)
    assert (kept > 0).sum(dim=-1).tolist() == [2, 2, 3]
    # 0 in float32: still the top token
    tiny = top_k_top_p(probs[1:2], torch.tensor([4]), torch.tensor([1e-46]))
    assert tiny.tolist() == [[0.5, 0.0, 0.0, 0.0]]


def test_top_p_matches_transformers():
    from transformers.generation.logits_process import TopPLogitsWarper

    torch.manual_seed(7)
    logits = torch.randn(4, V) * 2
    top_ps = [0.1, 0.5, 0.9, 0.99]
    kept = (
        top_k_top_p(
            torch.softmax(logits, -1), torch.full((4,), V, dtype=torch.int64), torch.tensor(top_ps)
        )
        > 0
    )
    for row, top_p in enumerate(top_ps):
        ref = TopPLogitsWarper(top_p)(None, logits[row : row + 1].clone())[0]
        assert torch.equal(kept[row], torch.isfinite(ref)), top_p


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-12] * (V - 3)]))
    st = tensors([SamplingParams(temperature=1.0)])
    torch.manual_seed(5)
    draws = [
        sample(
            logits.clone(),
            st,
            torch.zeros(1, dtype=torch.int64),
            torch.full((1, 1), -1),
            [[]],
            ProcessorSet(),
        ).next_ids.item()
        for _ in range(3000)
    ]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.04)


@pytest.mark.parametrize(
    "pieces, stops, released, matched",
    [
        # spans three pieces
        (
            ["Hello wo", "rld! STO", "P here"],
            ("STOP",),
            "Hello world! ",
            "STOP",
        ),
        (["a", "b", "c", "d"], ("bc",), "a", "bc"),
        (["The end.", "\n", "\nNext"], ("\n\n",), "The end.", "\n\n"),
        (["no match ", "at all"], ("xyz",), "no match at all", None),
        (["ab", "ab", "abx"], ("abx",), "abab", "abx"),
        (["earliest wins: B then A"], ("A", "B"), "earliest wins: ", "B"),
    ],
)
def test_stop_strings_across_pieces(pieces, stops, released, matched):
    m = StopMatcher(stops)
    out, found = "", None
    for i, piece in enumerate(pieces):
        text, found = m.feed(piece, final=i == len(pieces) - 1)
        out += text
        if found:
            break
    assert (out, found) == (released, matched)


def test_stop_string_prefix_is_held_back_while_streaming():
    m = StopMatcher(("</answer>",))
    assert m.feed("42 </ans", False) == ("42 ", None)  # could be the start of the stop string
    assert m.feed("wer", False) == ("", None)
    assert m.feed("!", False) == ("</answer!", None)  # it was not


def test_stop_string_across_the_min_new_tokens_boundary():
    m = StopMatcher(("END",))
    # before min_new_tokens nothing matches, but "E" may start a stop string
    assert m.release("xE") == "x"
    assert m.feed("ND more", False) == ("", "END")  # a match that ends after the boundary counts
    m = StopMatcher(("A", "END"))
    assert m.release("xAy") == "xAy"  # a whole stop string before the boundary is passed over...
    assert m.feed("z", False) == ("z", None)  # ...and does not match afterwards


@pytest.mark.parametrize("bad", ["nan_row", "nan_some", "posinf", "neginf_row", "mixed"])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "top_p_k_min_p", "penalties"])
def test_non_finite_logits_never_give_an_out_of_range_token(bad, kind):
    """NaN or infinite logits from the model (a broken checkpoint, an overflow in half precision) must
    not make the sampler return an id outside the vocabulary, whatever the sampling parameters."""
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    if bad == "nan_row":
        logits[:] = float("nan")
    elif bad == "nan_some":
        logits[:, ::3] = float("nan")
    elif bad == "posinf":
        logits[:, 5] = float("inf")
        logits[1, 9] = float("inf")
    elif bad == "neginf_row":
        logits[:] = float("-inf")
    else:
        logits[0] = float("nan")
        logits[1, 2] = float("inf")
        logits[2] = float("-inf")
        logits[3, ::2] = float("nan")
    base = {
        "greedy": dict(temperature=0.0),
        "sampled": dict(temperature=0.9, seed=1),
        "top_p_k_min_p": dict(temperature=1.0, top_p=0.5, top_k=3, min_p=0.1),
        "penalties": dict(
            temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5
        ),
    }[kind]
    params = [SamplingParams(**base)] * 4
    st = tensors(params, outputs=[[1, 2], [], [3], [4, 4]])
    out = sample(
        logits.clone(),
        st,
        torch.tensor([2, 0, 1, 2]),
        torch.full((4, 1), -1),
        [[1, 2], [], [3], [4, 4]],
        ProcessorSet(),
    )
    ids = out.next_ids.tolist()
    assert all(0 <= i < V for i in ids), (bad, kind, ids)


def test_top_k_past_int64_builds_as_the_whole_vocabulary():
    """A top_k no int64 holds (the scheduler only range-checks it as >= 1) must not make building the
    step's sampling tensors raise: that aborted every request admitted with it."""
    st = tensors(
        [SamplingParams(top_k=2**63), SamplingParams(top_k=10**30), SamplingParams(top_k=3)]
    )
    assert st.top_k.tolist() == [V, V, 3]


def test_penalty_and_bias_state_goes_when_the_last_row_using_it_leaves():
    """[B, V] counts, seen and bias cost a full pass each step (sample() at B=64: 16-18 ms without them,
    134-182 ms with): they must not outlive the rows that asked for them."""
    plain = SamplingParams(temperature=0)
    st = tensors(
        [
            plain,
            SamplingParams(repetition_penalty=1.2),
            SamplingParams(logit_bias=((4, 2.0),)),
            plain,
        ]
    )
    assert st.counts is not None and st.seen is not None and st.bias is not None
    no_penalty = st.filter(torch.tensor([True, False, True, True]), [True, False, True, True])
    assert no_penalty.counts is None and no_penalty.seen is None
    assert no_penalty.bias is not None and no_penalty.bias[1, 4] == 2.0
    neither = no_penalty.take(torch.tensor([0, 2]), [0, 2])
    assert neither.counts is None and neither.seen is None and neither.bias is None
    # a row that stays keeps its state, counts included
    kept = st.filter(torch.tensor([False, True, False, False]), [False, True, False, False])
    assert kept.counts is not None and kept.seen is not None and kept.bias is None
    # and a later merge with a penalized row still works from None
    merged = neither.merge(tensors([SamplingParams(frequency_penalty=0.5)]))
    assert merged.counts.shape == (3, V) and merged.bias is None


@pytest.mark.parametrize("greedy", [True, False])
def test_a_complete_grammar_ends_the_output_before_min_new_tokens(greedy):
    """Once a grammar is complete it allows only EOS, which min_new_tokens masks: the row was all -inf,
    drew token 0, and the grammar's refusal of it aborted a finished output. Grammar completion wins;
    a row with anything else allowed still cannot stop early."""
    logits = torch.randn(3, V)
    eos = 2

    def grammar(
        lg: torch.Tensor,
    ) -> None:  # row 0: complete (EOS only); rows 1 and 2: EOS or token 9
        allowed = torch.zeros_like(lg, dtype=torch.bool)
        allowed[:, eos] = True
        allowed[1:, 9] = True
        lg.masked_fill_(~allowed, float("-inf"))

    logits[:, eos] = 10.0  # EOS is the most likely wherever it is allowed
    st = tensors([SamplingParams(min_new_tokens=6, temperature=0.0 if greedy else 1.0)] * 3)
    out = sample(
        logits.clone(),
        st,
        torch.tensor([1, 1, 6]),
        StopTable.build([[eos]] * 3, "cpu"),
        [[]] * 3,
        ProcessorSet(),
        grammar=grammar,
    )
    assert out.next_ids.tolist() == [eos, 9, eos]


@pytest.mark.parametrize("u", [0.0, 0.5, 1 - 2**-53])
def test_a_draw_never_lands_on_a_token_filtered_out(u, monkeypatch):
    """The inverse of the cumulative distribution at the draw u lands on a token with probability: at
    u = 0 not on a leading token filtered out, near 1 on the last token left, never past it."""
    from engine.sampling import sampler

    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.3, 0.0], [0.1, 0.0, 0.2, 0.0]])
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k).fill_(u))
    st = SamplingTensors.build(
        [SamplingParams(temperature=1.0)] * 3, 4, "cpu", [[1]] * 3, [[]] * 3, [(False, 0)] * 3
    )
    picked = sampler.draw(probs, st, torch.zeros(3, dtype=torch.int64)).tolist()
    assert picked == {0.0: [0, 2, 0], 0.5: [1, 2, 2], 1 - 2**-53: [1, 2, 2]}[u]


@pytest.mark.parametrize("scale,measured_on", [(6.0, 256), (3.0, 4096), (0.1, 49152)])
def test_top_k_top_p_in_a_window_keeps_what_the_full_sort_keeps(scale, measured_on, monkeypatch):
    """top_k / top_p measured on each row's most likely tokens (topk) first, the vocabulary sorted only
    where a cut ends past them (a flat row's nucleus): the same tokens kept either way. `scale` makes the
    last row peaked (its nucleus ends in the first window), broad (the second) or flat (the sort); that
    row alone goes past the first window (one broad row sent the batch to a sort: 493 ms at batch 64)."""
    from engine.sampling import sampler

    torch.manual_seed(8)
    logits = torch.randn(5, 49152) * torch.tensor([[6.0], [6.0], [3.0], [6.0], [scale]])
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.tensor([49152, 40, 49152, 200, 49152])
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.5, 0.9])
    seen, real = [], sampler._dropped
    monkeypatch.setattr(
        sampler, "_dropped", lambda p, k, q: seen.append(tuple(p.shape)) or real(p, k, q)
    )
    windowed = top_k_top_p(probs, top_k, top_p)
    # only the row the window did not hold goes on
    assert seen[-1] == (1 if measured_on > 256 else 4, measured_on), seen
    monkeypatch.setattr(sampler, "TOP_WINDOWS", ())
    full = top_k_top_p(probs, top_k, top_p)
    assert torch.equal(windowed, full)
    assert torch.equal(windowed[2], probs[2]) and int((windowed[1] > 0).sum()) == 40

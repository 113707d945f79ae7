"""Layer fields with beam search on the session's float32 engine, against transformers: a steered
beam search equals generate(num_beams=k) with a forward hook adding the vector; the prompt's hidden
states come back with the hypotheses, and each hypothesis's generated rows are those of its own
tokens (its beams reordered at every step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.beam_search.hidden import BeamStates
from engine.beam_search.selection import BeamSelection
from engine.taps.checks import hidden_spec, size_problem
from engine.taps.spec import LayerRequest

from conftest import PROMPTS
from helpers import engine_idle
from hf_reference import hf_states, one_thread, row_error
from test_beam_search import _same, hf_beam_search

LAYER = 12


@pytest.fixture(scope="module")
def vector(engine) -> torch.Tensor:
    hidden = engine.server_info["hidden_size"]
    return torch.randn(hidden, generator=torch.Generator().manual_seed(3)) * 4.0


def test_a_steered_beam_search_matches_transformers_with_a_hook(
    engine, hf_model, tokenizer, vector
):
    ids = tokenizer.encode(PROMPTS[1])
    steering = [{"layer": LAYER, "vector": vector.tolist()}]
    ours = engine.beam_search(input_ids=ids, beam_width=3, max_new_tokens=10, steering=steering)

    def add(module, args, output):
        return (
            (output[0] + vector,) + tuple(output[1:])
            if isinstance(output, tuple)
            else output + vector
        )

    handle = hf_model.model.layers[LAYER].register_forward_hook(add)
    try:
        ref = hf_beam_search(hf_model, ids, 3, 10)
    finally:
        handle.remove()
    _same(ours["hypotheses"], ref, tokenizer.eos_token_id)
    plain = engine.beam_search(input_ids=ids, beam_width=3, max_new_tokens=10)
    assert plain["hypotheses"][0]["output_ids"] != ours["hypotheses"][0]["output_ids"]
    assert engine_idle(engine.get_stats())  # the steered search's private K/V all went back


def test_a_beam_search_returns_its_prompts_hidden_states(engine, hf_model, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    out = engine.beam_search(
        input_ids=ids,
        beam_width=2,
        max_new_tokens=4,
        return_hidden_states={"layers": [0, LAYER], "tokens": "prompt"},
    )
    hs = out["meta_info"]["hidden_states"]
    assert hs["layers"] == [0, LAYER] and hs["prompt"].shape == (
        2,
        len(ids),
        hf_model.config.hidden_size,
    )
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(hs["layers"]):
        want = ref[layer + 1][0]
        scale = want.abs().amax(dim=-1).clamp(min=1.0)
        assert float(((hs["prompt"][j] - want).abs().amax(dim=-1) / scale).max()) <= 1e-5


def _check_hypotheses(out: dict, hf_model, ids: list[int], tokens: str) -> None:
    """Each returned hypothesis's generated rows are transformers' states over prompt + its own
    tokens, one row per token (row k: the position that predicted token k); "all" adds the prompt's."""
    hs, hyps = out["meta_info"]["hidden_states"], out["hypotheses"]
    generated = hs["generated"]
    assert isinstance(generated, list) and len(generated) == len(hyps) > 1
    p, hidden = len(ids), hf_model.config.hidden_size
    for h, rows in zip(hyps, generated):
        n = len(h["output_ids"])
        assert rows.shape == (len(hs["layers"]), n, hidden)
        with one_thread():
            ref = hf_states(hf_model, ids + h["output_ids"], hs["layers"])
        assert row_error(rows, ref[:, p - 1 : p - 1 + n]) <= 5e-5, h["output_ids"]
        if tokens == "all":
            assert row_error(hs["prompt"], ref[:, :p]) <= 5e-5
    if tokens == "generated":
        assert "prompt" not in hs


def _branches_late(hyps: list[dict]) -> bool:
    """Whether two hypotheses share their first tokens and part later: beams were reordered mid-way."""
    ids = [h["output_ids"] for h in hyps]
    return any(a[:2] == b[:2] and a != b for i, a in enumerate(ids) for b in ids[i + 1 :])


@pytest.mark.parametrize("tokens", ["generated", "all"])
def test_each_hypothesis_gets_the_hidden_states_of_its_own_tokens(
    engine, hf_model, tokenizer, tokens
):
    ids = tokenizer.encode(PROMPTS[1])
    layers = [0, LAYER, -1]
    plain = engine.beam_search(
        input_ids=ids, beam_width=3, max_new_tokens=8, num_return_sequences=3
    )
    out = engine.beam_search(
        input_ids=ids,
        beam_width=3,
        max_new_tokens=8,
        num_return_sequences=3,
        return_hidden_states={"layers": layers, "tokens": tokens},
    )
    assert out["hypotheses"] == plain["hypotheses"]  # the states change nothing else
    assert "hidden_states" not in plain["meta_info"]
    assert out["meta_info"]["hidden_states"]["layers"] == [0, LAYER, 29]
    assert _branches_late(out["hypotheses"])
    _check_hypotheses(out, hf_model, ids, tokens)
    assert engine_idle(engine.get_stats())


def test_a_hypothesis_that_finished_early_keeps_its_rows(engine, hf_model, tokenizer):
    """A stop token ends some hypotheses before others: each keeps the rows it had when it finished,
    while the live beams go on reordering; the result matches transformers' beam search."""
    ids = tokenizer.encode(PROMPTS[2])
    first = engine.beam_search(input_ids=ids, beam_width=3, max_new_tokens=8)
    stop = first["hypotheses"][0]["output_ids"][2]  # ends the best hypothesis at its third token
    kwargs = dict(input_ids=ids, beam_width=3, max_new_tokens=8, num_return_sequences=3)
    out = engine.beam_search(
        **kwargs,
        stop_token_ids=[stop],
        return_hidden_states={"layers": [LAYER], "tokens": "all"},
    )
    lengths = {len(h["output_ids"]) for h in out["hypotheses"]}
    assert len(lengths) > 1, out["hypotheses"]  # some finished early, some ran on
    assert out["hypotheses"] == engine.beam_search(**kwargs, stop_token_ids=[stop])["hypotheses"]
    _check_hypotheses(out, hf_model, ids, "all")


class _ReorderEveryStep:
    """The reference: every slot's whole history, gathered by its source at every selection."""

    def __init__(self, width: int, max_new: int, first: torch.Tensor) -> None:
        self.k = width
        self.rows = torch.zeros(2 * width, first.shape[0], max_new, first.shape[1])
        self.rows[width:, :, 0] = first

    def select(self, sel: BeamSelection, step: torch.Tensor | None) -> None:
        t = sel.steps - 1
        if step is not None:
            self.rows[self.k :, :, t] = step.transpose(0, 1)
        self.rows[:, :, : t + 1] = self.rows[:, :, : t + 1][sel.row_sources()]


def _search(seed: int, width: int, max_new: int, layers: int = 2, hidden: int = 3):
    """A beam search over random log-probabilities and random rows, both bookkeepings fed alike;
    a stop token ends some hypotheses early."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 6
    taps = SimpleNamespace(chunks=[torch.randn(layers, 4, hidden, generator=gen)], beam_step=[])
    sel = BeamSelection(width, max_new, (0,), length_penalty=1.0)
    logprobs = torch.log_softmax(torch.randn(1, vocab, generator=gen), dim=-1)
    sel.step(logprobs)
    ours, ref = BeamStates(sel, taps), _ReorderEveryStep(width, max_new, taps.chunks[-1][:, -1])
    ours.select(sel, None)
    ref.select(sel, None)
    while not sel.done:
        step = torch.randn(layers, width, hidden, generator=gen)
        sel.step(torch.log_softmax(torch.randn(width, vocab, generator=gen), dim=-1))
        taps.beam_step.append(step)
        assert ours.take_step(sel, taps) is None and not taps.beam_step
        ref.select(sel, step)
    return sel, ours, ref


@pytest.mark.parametrize("seed", range(12))
def test_beam_states_gather_what_reordering_every_step_gives(seed):
    """Rows gathered at the end along each hypothesis's sources equal, bit for bit, the histories
    reordered at every selection, for early-finished hypotheses and fewer returned than beams."""
    width, max_new = 4, 9
    sel, ours, ref = _search(seed, width, max_new)
    hyps = sel.results(width - 1)
    assert hyps
    got = ours.generated(hyps)
    want = torch.cat([ref.rows[h.slot, :, : len(h.output_ids)] for h in hyps], dim=1)
    assert got.shape == want.shape and torch.equal(got, want)
    assert not ours.rows and not ours.sources  # let go at the end


def test_some_random_searches_finish_hypotheses_early():
    lengths = set()
    for seed in range(12):
        sel, _, _ = _search(seed, 4, 9)
        lengths |= {len(h.output_ids) for h in sel.results(3)}
    assert len(lengths) > 2, lengths


def test_beam_states_hold_only_the_rows_computed():
    """K rows per step, none for the steps a search never reached, nothing per finished slot."""
    sel, ours, _ = _search(1, 4, 400)
    held = {r.untyped_storage().data_ptr(): r.untyped_storage().nbytes() for r in ours.rows[1:]}
    assert sum(held.values()) == 4 * 2 * 3 * 4 * (sel.steps - 1)


def test_a_step_without_exactly_one_capture_fails_that_search():
    sel, ours, _ = _search(2, 3, 400)
    sel.step(torch.log_softmax(torch.randn(3, 6), dim=-1))
    taps = SimpleNamespace(beam_step=[])
    assert "expected one capture" in ours.take_step(sel, taps)
    taps.beam_step += [torch.zeros(2, 3, 3), torch.zeros(2, 3, 3)]
    assert "got 2" in ours.take_step(sel, taps) and not taps.beam_step
    taps.beam_step.append(torch.zeros(2, 5, 3))
    assert "rows of 3 beams" in ours.take_step(sel, taps)


def test_the_size_bound_counts_the_beams_held_and_the_hypotheses_returned():
    spec = LayerRequest(hidden_spec({"layers": [0, 1], "tokens": "generated"}, 4))
    row = 2 * 8 * 4  # two layers of 8 floats
    assert size_problem(spec, 5, 10, 8, (4 + 2) * 10 * row, hypotheses=2, width=4) is None
    problem = size_problem(spec, 5, 10, 8, (4 + 2) * 10 * row - 1, hypotheses=2, width=4)
    assert "beam_width 4 x max_new_tokens 10" in problem and "max_hidden_state_bytes" in problem
    assert size_problem(spec, 5, 10, 8, 10 * row) is None  # not a beam search: its own rows


def test_beam_search_refuses_hidden_states_its_beams_would_hold_over_the_bound(engine):
    """30 layers x (8 beams + 8 returned) x 100 tokens x 576 floats is over 64 MiB: refused before
    anything is queued; the 8 returned alone (53 MiB) would not be."""
    everything = {"layers": list(range(30)), "tokens": "generated"}
    with pytest.raises(ValueError, match="return_hidden_states"):
        engine.beam_search(
            "Hi",
            beam_width=8,
            num_return_sequences=8,
            max_new_tokens=100,
            return_hidden_states=everything,
        )

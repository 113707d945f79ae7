"""Plugin layer taps end to end (tests/layer_tap_plugin.py): what a tap sees, a failing tap fails
only its requests, a writing tap steers as steering does, and untapped steps carry no tap plan."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from engine import Engine
from engine.hooks.loader import unload_plugins
from helpers import engine_idle

PLUGIN = "layer_tap_plugin:plugin"
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tapped(tmp_path_factory):
    out = tmp_path_factory.mktemp("taps")
    os.environ["LAYER_TAP_DIR"] = str(out)  # the children inherit it at spawn
    eng = Engine(dtype="float32", max_total_tokens=4096, plugins=PLUGIN)
    try:
        yield eng, out
    finally:
        eng.shutdown()
        unload_plugins([PLUGIN])
        os.environ.pop("LAYER_TAP_DIR", None)


def clear(out) -> None:
    for name in os.listdir(out):
        os.remove(os.path.join(out, name))


def records(out) -> list[dict]:
    return [torch.load(os.path.join(out, n)) for n in sorted(os.listdir(out)) if n.endswith(".pt")]


def steps(out) -> list[tuple[bool, list[str]]]:
    path = os.path.join(out, "steps.log")
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    return [(line.split(" ")[0] == "1", line.split(" ")[1:]) for line in lines]


def test_a_tap_sees_its_requests_rows_and_the_same_values_hidden_states_return(tapped):
    eng, out = tapped
    clear(out)
    prompt = "The capital of France is"
    n = len(eng.tokenizer.encode(prompt))
    res = eng.generate(
        [prompt, "Hello there"],
        GREEDY,
        rid=["rec-a", "plain-b"],
        layer_taps=None,
    )
    assert not records(out)  # nobody asked
    clear(out)
    got = eng.generate(
        prompt,
        GREEDY,
        rid="rec-c",
        layer_taps=["record"],
        return_hidden_states={"layers": [3, 20], "tokens": "all"},
    )
    assert got["output_ids"] == res[0]["output_ids"]  # reading changes nothing
    recs = records(out)
    assert {r["layer"] for r in recs} == {3, 20}
    assert all(r["rids"] == ["rec-c"] * len(r["rids"]) and r["point"] == "resid_post" for r in recs)
    layer3 = [r for r in recs if r["layer"] == 3]
    positions = [p for r in layer3 for p in r["positions"]]
    # every prompt position, then one per decode step (the last token is never fed back)
    assert positions == list(range(n + GREEDY["max_new_tokens"] - 1))
    assert layer3[0]["mode"] == "prefill" and {r["mode"] for r in layer3[1:]} == {"decode"}
    assert all(b is None for r in layer3 for b in r["beams"])
    rows = torch.cat([r["values"] for r in layer3])
    hs = got["meta_info"]["hidden_states"]
    assert torch.equal(rows[:n], hs["prompt"][0])
    assert torch.equal(rows[n - 1 :], hs["generated"][0, : rows.shape[0] - n + 1])


def test_a_failing_tap_fails_only_its_requests(tapped):
    """The tap fails the requests whose rows it was given (both that asked for it here), not the
    request beside them that asked for nothing."""
    eng, _ = tapped
    alone = eng.generate("Tell me a story", GREEDY)

    async def both():
        return await asyncio.gather(
            eng.async_generate(
                ["Tell me a story"] * 2, GREEDY, rid=["tapboom-1", "tapped-1"], layer_taps=["boom"]
            ),
            eng.async_generate("Tell me a story", GREEDY, rid="calm-1"),
        )

    (bad, tapped_too), calm = asyncio.run(both())
    for res in (bad, tapped_too):
        assert res["meta_info"]["finish_reason"]["type"] == "abort"
        message = res["meta_info"]["finish_reason"]["message"]
        assert (
            "layer_tap_plugin" in message and "'boom'" in message and "the probe broke" in message
        )
    assert calm["meta_info"]["finish_reason"]["type"] == "length"
    assert calm["output_ids"] == alone["output_ids"]
    assert eng.generate("Tell me a story", GREEDY)["output_ids"] == alone["output_ids"]
    # its last step too: a one-token request fails, not a normal finish without the tap's change
    last = eng.generate(
        "Tell me a story", {**GREEDY, "max_new_tokens": 1}, rid="tapboom-2", layer_taps=["boom"]
    )
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and last["output_ids"] == []
    assert engine_idle(eng.get_stats())


def test_a_writing_tap_steers_as_steering_with_its_vector_does(tapped):
    eng, _ = tapped
    prompt = "My favourite food is"
    plain = eng.generate(prompt, GREEDY)["output_ids"]
    by_tap = eng.generate(prompt, GREEDY, layer_taps=["add"])["output_ids"]
    by_name = eng.generate(prompt, GREEDY, steering=[{"layer": 10, "vector": "unit"}])["output_ids"]
    assert by_tap == by_name != plain
    # neither left its K/V in the prefix cache: the plain prompt is answered as before
    again = eng.generate(prompt, GREEDY)
    assert again["output_ids"] == plain


def test_untapped_steps_carry_no_plan_and_tapped_ones_do(tapped):
    eng, out = tapped
    clear(out)
    eng.generate("Count to five", GREEDY, rid="quiet-1")
    eng.generate(
        "Count to five",
        GREEDY,
        rid="loud-1",
        steering=[{"layer": 2, "vector": "unit", "scale": 0.1}],
    )
    seen = steps(out)
    quiet = [t for t, rids in seen if rids == ["quiet-1"]]
    loud = [t for t, rids in seen if rids == ["loud-1"]]
    assert quiet and not any(quiet)
    assert loud and all(loud)


def test_unknown_tap_names_and_vectors_are_refused_up_front(tapped):
    eng, _ = tapped
    with pytest.raises(ValueError, match="layer_taps names \\['nope'\\]"):
        eng.generate("Hi", GREEDY, layer_taps=["nope"])
    with pytest.raises(ValueError, match="steering\\[0\\].vector: no plugin registered"):
        eng.generate("Hi", GREEDY, steering=[{"layer": 1, "vector": "nope"}])

"""The tap registry and a step's TapPlan in-process, on small tensors: which rows each site steers,
hands to a tap and captures; taps every request gets; malformed taps left out with a log line."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import hooks
from engine.hooks import hookimpl
from engine.hooks.runtime import refresh
from engine.taps import LayerTap, TapRows
from engine.taps.plan import Segment, TapPlan
from engine.taps.registry import TapRegistry
from engine.taps.request import RequestTaps
from engine.taps.spec import HiddenSpec, LayerRequest, SteerSpec

LAYERS, HIDDEN = 4, 3


class Taps:
    def __init__(self) -> None:
        self.seen: list[TapRows] = []

    def read(self, rows: TapRows) -> None:
        self.seen.append(rows)

    def double(self, rows: TapRows) -> None:
        rows.values *= 2

    @hookimpl
    def engine_layer_taps(self, num_layers):
        return [
            LayerTap("all", (-1,), self.read, every_request=True),
            LayerTap("double", (1,), self.double, writes=True),
            LayerTap("bad-point", (1,), self.read, points=("nowhere",)),
            LayerTap("bad-layer", (num_layers,), self.read),
            LayerTap("all", (0,), self.read),  # a second tap of one name
        ]

    @hookimpl
    def engine_steering_vectors(self):
        return {"ones": [1.0] * HIDDEN}


@pytest.fixture
def plugin():
    taps = Taps()
    hooks.plugin_manager().register(taps, name="tap-plan-test")
    refresh()
    yield taps
    hooks.plugin_manager().unregister(name="tap-plan-test")
    refresh()


@pytest.fixture
def registry(plugin) -> TapRegistry:
    return TapRegistry(LAYERS, HIDDEN, "cpu", torch.float32)


def test_the_registry_keeps_well_formed_taps_and_logs_the_others(registry, caplog):
    with caplog.at_level(logging.ERROR):
        taps = registry.taps()
    assert sorted(taps) == ["all", "double"]
    assert taps["all"].layers == (LAYERS - 1,) and taps["all"].plugin == "tap-plan-test"
    logged = caplog.text
    assert "nowhere" in logged and "bad-layer" in logged and "declared twice" in logged
    assert [t.name for t in registry.every_request()] == ["all"]
    assert registry.active  # a tap on every request: every step is planned
    assert registry.vector("ones") == [1.0] * HIDDEN
    with pytest.raises(ValueError, match="no plugin registered a steering vector named 'x'"):
        registry.vector("x")


def test_a_plan_steers_taps_and_captures_each_requests_own_rows(registry, plugin):
    # request a: prompt of 3 at rows 0-2, hidden states of layers 1 and 3, every position
    a = RequestTaps(LayerRequest(HiddenSpec((1, 3), "all"), taps=("double",)), 3, 4, registry)
    # request b: 2 rows after a cached prefix of 5 (positions 5, 6), steered at layer 1 by "ones" x 2
    b = RequestTaps(LayerRequest(steering=(SteerSpec(1, name="ones", scale=2.0),)), 7, 4, registry)
    assert b.private_kv and a.private_kv  # steered; a writing tap
    plan = TapPlan("prefill")
    plan.add(Segment("a", a, 0, 0, 3), registry.every_request())
    plan.add(Segment("b", b, 3, 5, 2), registry.every_request())
    plan = plan.finalize("cpu")
    x = torch.arange(5 * HIDDEN, dtype=torch.float32).reshape(5, HIDDEN)
    for layer in range(LAYERS):
        before = x.clone()
        x = plan.at(layer, "resid_post", x)
        if layer == 1:  # a's rows doubled by its writing tap, b's steered by 2
            assert torch.equal(x[:3], before[:3] * 2)
            assert torch.equal(x[3:], before[3:] + 2.0)
            captured_1 = x[:3].clone()
        elif layer != LAYERS - 1:
            assert torch.equal(x, before)
    plan.deliver()
    (chunk,) = a.chunks
    assert chunk.shape == (2, 3, HIDDEN)
    assert torch.equal(chunk[0], captured_1) and torch.equal(chunk[1], x[:3])
    assert a.next_pos == 3 and not b.chunks
    # the tap on every request saw both requests' rows at the last layer
    (seen,) = plugin.seen
    assert seen.layer == LAYERS - 1 and seen.rids == ["a"] * 3 + ["b"] * 2
    assert seen.positions == [0, 1, 2, 5, 6] and seen.mode == "prefill"


def test_a_failing_tap_marks_its_rows_requests(registry):
    def boom(rows: TapRows) -> None:
        raise RuntimeError("no")

    plan = TapPlan("decode")
    tap = LayerTap("boom", (2,), boom, plugin="p")
    plan.add(Segment("a", None, 0, 9, 1, beam=0), [tap])
    plan.add(Segment("b", None, 1, 4, 1), [])
    plan = plan.finalize("cpu")
    x = torch.ones(2, HIDDEN)
    assert torch.equal(plan.at(2, "resid_post", x), torch.ones(2, HIDDEN))
    assert list(plan.failed) == ["a"]
    assert "plugin 'p' failed in layer tap 'boom': RuntimeError: no" == plan.failed["a"]


def test_prompt_rows_limit_the_prefix_and_a_position_is_captured_once(registry):
    t = RequestTaps(LayerRequest(HiddenSpec((0,), "prompt")), 10, 4, registry)
    assert t.prefix_limit() == 0
    assert t.wanted(0, 6) == (0, 6) and t.prefix_limit() == 6
    assert t.wanted(3, 5) == (6, 8)  # recomputed after a retraction: 3-5 were taken already
    assert t.wanted(8, 6) == (8, 10) and t.prefix_limit() is None
    last = RequestTaps(LayerRequest(HiddenSpec((0,), "last")), 10, 4, registry)
    assert last.prefix_limit() == 9 and last.wanted(0, 9) is None and last.wanted(9, 1) == (9, 10)


def test_the_scheduler_refuses_layers_the_model_lacks(registry):
    """A message that skipped the user process's checks is refused alone, not failing a step."""
    with pytest.raises(ValueError, match="layers \\[9\\]"):
        RequestTaps(LayerRequest(HiddenSpec((9,), "last")), 3, 1, registry)
    with pytest.raises(ValueError, match="layers \\[4\\]"):
        RequestTaps(LayerRequest(steering=(SteerSpec(4, name="ones"),)), 3, 1, registry)
    with pytest.raises(ValueError, match="point"):
        RequestTaps(LayerRequest(HiddenSpec((1,), "last", "nowhere")), 3, 1, registry)

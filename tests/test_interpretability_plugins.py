"""The three interpretability example plugins end to end on the real SmolLM2 engine (float32): capture
writes shards whose rows are the request's own hidden states; the logit lens at the last layer picks
the model's greedy tokens; a contrast vector, registered by name, steers exactly as the same vector
inline does, and changes the output."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import Engine
from engine.hooks.loader import unload_plugins
from engine.plugins.capture_activations import read_shards
from engine.plugins.logit_lens import table
from engine.plugins.steer_contrast import load_vector, make_vector

MODULE = "interp_example_plugins"
PLUGINS = [f"{MODULE}:capture", f"{MODULE}:lens", f"{MODULE}:steer"]
STEER_LAYER = 12
STEER_SCALE = 8.0
CAPTURE_LAYERS = (3, -1)


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def interp(tmp_path_factory, engine):
    """One engine with the three plugins, configured through their arguments in a module of the
    test's own; the steering vector made first on the session's plain engine."""
    base = tmp_path_factory.mktemp("interp")
    vector = make_vector(
        engine,
        ["I love you", "Love and joy"],
        ["I hate you", "Hate and anger"],
        STEER_LAYER,
        path=str(base / "love.safetensors"),
        name="love",
    )
    (base / f"{MODULE}.py").write_text(
        textwrap.dedent(
            f"""
            from engine.plugins.capture_activations import CaptureActivations
            from engine.plugins.logit_lens import LogitLens
            from engine.plugins.steer_contrast import SteerContrast

            capture = CaptureActivations(directory={str(base / "acts")!r}, layers={CAPTURE_LAYERS!r},
                                         point="resid_post", shard_rows=1, every_request=False)
            lens = LogitLens(layers=(0, 15, -1), top_k=3,
                             file={str(base / "lens.jsonl")!r})
            steer = SteerContrast(paths=[{str(base / "love.safetensors")!r}])
            """
        )
    )
    sys.path.insert(0, str(base))
    eng = Engine(dtype="float32", max_total_tokens=4096, plugins=",".join(PLUGINS))
    try:
        yield eng, base, vector
    finally:
        eng.shutdown()
        unload_plugins(PLUGINS)  # the session's other engines must not see them in this process
        sys.path.remove(str(base))
        sys.modules.pop(MODULE, None)


def test_capture_shards_hold_the_requests_hidden_states(interp):
    eng, base, _ = interp
    out = eng.generate(
        "The quick brown fox jumps over",
        greedy(4),
        rid="cap-1",
        layer_taps=["capture"],
        return_hidden_states={"layers": list(CAPTURE_LAYERS), "tokens": "all"},
    )
    # one row a shard: the next tapped request's first step writes cap-1's last step
    eng.generate("Another prompt", greedy(2), rid="cap-2", layer_taps=["capture"])
    assert len(list((base / "acts").glob("capture-*.safetensors"))) > 1
    data = read_shards(str(base / "acts"))
    mine = [i for i, rid in enumerate(data["rids"]) if rid == "cap-1"]
    states = out["meta_info"]["hidden_states"]
    # positions 0..P-1 from the prompt, then the generated tokens fed back (the last never is)
    expected = torch.cat([states["prompt"], states["generated"][:, 1:]], dim=1)
    assert data["positions"][mine].tolist() == list(range(expected.shape[1]))
    assert (data["beams"][mine] == -1).all()
    for j, layer in enumerate(states["layers"]):
        assert torch.equal(data[f"layer_{layer}"][mine], expected[j]), layer
    assert "cap-2" in data["rids"]


def test_logit_lens_at_the_last_layer_is_the_greedy_choice(interp):
    eng, base, _ = interp
    out = eng.generate(
        "The capital of France is", greedy(6), rid="lens-1", layer_taps=["logit_lens"]
    )
    name = f"{MODULE}:lens"
    record = eng.get_stats()["plugins"]["scheduler"][name]["requests"]["lens-1"]
    p = record["prompt_tokens"]
    assert record["positions"] == list(range(p - 1, p - 1 + 6))
    config = json.loads((Path(eng.model_dir) / "config.json").read_text())
    last = str(config["num_hidden_layers"] - 1)
    assert set(record["layers"]) == {"0", "15", last}
    assert [ids[0] for ids in record["layers"][last]["top_ids"]] == out["output_ids"]
    for probs in record["layers"]["0"]["top_probs"]:
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001
    # the same record in the JSON lines file, and a table a person can read
    lines = [json.loads(line) for line in (base / "lens.jsonl").read_text().splitlines()]
    assert any(r == record for r in lines)
    assert table(record, eng.tokenizer).count("\n") == 2


def test_a_contrast_vector_steers_by_name_as_inline(interp):
    eng, base, vector = interp
    name, layer, loaded = load_vector(str(base / "love.safetensors"))
    assert (name, layer) == ("love", STEER_LAYER) and loaded == vector.tolist()
    prompt = "I think that you are"
    plain = eng.generate(prompt, greedy(6))
    named = eng.generate(
        prompt, greedy(6), steering=[{"layer": STEER_LAYER, "vector": "love", "scale": STEER_SCALE}]
    )
    inline = eng.generate(
        prompt,
        greedy(6),
        steering=[{"layer": STEER_LAYER, "vector": vector.tolist(), "scale": STEER_SCALE}],
    )
    assert named["output_ids"] != plain["output_ids"]
    assert named["output_ids"] == inline["output_ids"]

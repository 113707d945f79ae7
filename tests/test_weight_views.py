"""Weights packed or converted at load from views of their file (engine/model/weight_views.py): the same
values as a plain read, one scratch buffer for stacked parts, the file's pages given back as it goes,
and a model packed from the file computing exactly what one packed from read weights computes."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from engine.model.config import load_hf_config, model_config_from_hf
from engine.linear.f32_panels import F32Linear
from engine.model.llama import weight_plan
from engine.model.loader import index_weights, load_model, read_planned
from engine.linear.onednn import PackedLinear, packing_available
from engine.model.weight_views import WeightViews


def _plan(model_dir: str):
    entries = index_weights(model_dir)
    return entries, weight_plan(
        model_config_from_hf(load_hf_config(model_dir), model_dir), set(entries)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_weights_equal_the_read_ones(tiny_llama_dir, dtype):
    entries, plan = _plan(tiny_llama_dir)
    views = WeightViews()
    try:
        for name in (
            "layers.0.self_attn.qkv_proj.weight",
            "layers.0.mlp.gate_up_proj.weight",
            "layers.1.self_attn.o_proj.weight",
            "norm.weight",
        ):
            got = views.stacked([entries[p] for p in plan[name]], dtype)
            want = read_planned({name: plan[name]}, entries, dtype)[name]
            assert got.dtype == dtype and torch.equal(got, want), name
    finally:
        views.close()


def test_one_scratch_buffer_serves_every_stacked_weight(tiny_llama_dir):
    """Parts are stacked into one buffer, reused (touched once); a one-part weight of the dtype is the file."""
    entries, plan = _plan(tiny_llama_dir)
    views = WeightViews()
    try:
        first = views.stacked(
            [entries[p] for p in plan["layers.0.mlp.gate_up_proj.weight"]], torch.float32
        )
        second = views.stacked(
            [entries[p] for p in plan["layers.1.mlp.gate_up_proj.weight"]], torch.float32
        )
        assert first.data_ptr() == second.data_ptr()
        plain = views.stacked(
            [entries[p] for p in plan["layers.1.mlp.down_proj.weight"]], torch.float32
        )
        assert plain.data_ptr() != second.data_ptr()
    finally:
        views.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_pages_of_a_handed_out_weight_go_back_on_the_next_call(tmp_path):
    def resident_kb(path) -> int:
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(1024, 1024), "b": torch.randn(16, 16)}, str(path))
    entries = index_weights(str(tmp_path))
    views = WeightViews()
    try:
        a = views.stacked([entries["a"]], torch.float32)
        assert float(a.sum()) == float(a.sum())  # every page of a read
        assert resident_kb(path) >= 4000  # 4 MB mapped in
        views.stacked([entries["b"]], torch.float32)
        assert resident_kb(path) < 100
    finally:
        views.close()


def test_a_model_packed_from_its_file_computes_what_read_weights_packed_compute(tiny_llama_dir):
    if not packing_available(torch.float32, "cpu"):
        pytest.skip(
            "float32 is not packed on this CPU (AVX-512 keeps MKL): the loader reads every weight"
        )
    model, cfg = load_model(
        tiny_llama_dir, load_hf_config(tiny_llama_dir), torch.float32, "cpu", 64
    )
    entries, plan = _plan(tiny_llama_dir)
    read = read_planned(plan, entries, torch.float32)
    x = torch.randn(5, cfg.hidden_size)
    packed = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, (PackedLinear, F32Linear, nn.Linear))
    ]
    assert len(packed) == 4 * cfg.num_layers + 1  # every layer and the lm_head's own copy
    for name, layer in packed:
        weight = read[
            "embed_tokens.weight"
            if name == "lm_head" and cfg.tie_word_embeddings
            else f"{name}.weight"
        ]
        # AVX-512: MKL keeps plain weights, copied out of the file's views
        if isinstance(layer, nn.Linear):
            assert (
                torch.equal(layer.weight, weight)
                and layer.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
            )
            continue
        bias = getattr(layer, "bias", None)  # F32Linear takes no bias
        plain = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        plain.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            plain.bias = nn.Parameter(bias.clone(), requires_grad=False)
        inputs = x if weight.shape[1] == cfg.hidden_size else torch.randn(5, weight.shape[1])
        again = (
            F32Linear(plain, layer._lib) if isinstance(layer, F32Linear) else PackedLinear(plain)
        )
        assert torch.equal(layer(inputs), again(inputs)), name
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    "field, change",
    [("intermediate_size", -32), ("intermediate_size", 32), ("num_key_value_heads", 2)],
)
def test_a_config_that_does_not_fit_its_weights_is_refused_when_packing_from_the_file(
    tiny_llama_dir, tmp_path, field, change
):
    """Layers packed straight from the file were never checked against the config's shapes (reading
    them all, load_state_dict was): a smaller intermediate_size computed with the wrong weights, a
    larger one packed past the end of the file's tensor. Either is now refused naming the weight."""
    import json
    import shutil

    if not packing_available(torch.float32, "cpu"):
        pytest.skip(
            "float32 is not packed on this CPU (AVX-512 keeps MKL): the loader reads every weight"
        )
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = config[field] + change if field == "intermediate_size" else change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not fit"):
        load_model(str(folder), load_hf_config(str(folder)), torch.float32, "cpu", 64)


def test_rope_settings_transformers_takes_are_taken_and_those_it_recomputes_per_length_refused():
    """A config.json whose rope_parameters are `{"rope_type": "default"}` with rope_theta at the top
    level (transformers takes it) failed with KeyError 'rope_theta'; `longrope`, which transformers
    switches to its long factors past original_max_position_embeddings, was taken with its short
    factors at every length (cos off by 2 at position 100 in a reviewer's run): refused, as
    `dynamic` is."""
    from types import SimpleNamespace

    from engine.model.rope import inv_freq_and_scaling

    top = SimpleNamespace(rope_parameters={"rope_type": "default"}, rope_theta=500000.0)
    inv_freq, scaling = inv_freq_and_scaling(top, 16)
    assert scaling == 1.0 and torch.allclose(
        inv_freq, 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    )
    long = SimpleNamespace(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64,
        }
    )
    with pytest.raises(ValueError, match="longrope"):
        inv_freq_and_scaling(long, 16)


def test_rotary_inv_freq_buffers_older_checkpoints_hold_are_ignored(tiny_llama_dir):
    """Older exports saved each layer's `rotary_emb.inv_freq` buffer; transformers drops them, the
    engine refused the checkpoint as holding unexpected weights."""
    cfg = model_config_from_hf(load_hf_config(tiny_llama_dir))
    names = set(index_weights(tiny_llama_dir)) | {
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(cfg.num_layers)
    }
    plan = weight_plan(cfg, names)
    assert not any("inv_freq" in part for parts in plan.values() for part in parts)

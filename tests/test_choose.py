"""The choice table (engine/linear/choose.py): one row per layer, A/B overrides checked and honoured,
the decode path chosen from the layers, and `engine info` printing the choices."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels.cpu import load_native
from engine.linear.choose import ROWS, Layer, Where, check_overrides, choose, choose_decode_path
from engine.model.config import load_hf_config
from engine.model.loader import kernel_info, load_model


def test_unknown_rows_and_values_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown row 'f32-linear'"):
        EngineConfig(kernel_overrides={"f32-linear": "off"}).validate()
    with pytest.raises(ValueError, match="must be 'on' or 'off'"):
        check_overrides({"onednn": "0"})
    with pytest.raises(ValueError, match="unknown row 'torch'"):  # the last row takes every layer
        check_overrides({"torch": "off"})
    EngineConfig(kernel_overrides={"f32-blocks": "off", "torch-plain": "on"}).validate()


def test_every_row_is_named_once_with_a_reason():
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names)) and names[-1] == "torch"
    assert all(row.reason for row in ROWS)


def test_rows_decide_by_mode_dtype_cpu_and_shape():
    head, biased = (
        Layer("lm_head", 64, 32, False),
        Layer("layers.0.self_attn.qkv_proj", 96, 32, True),
    )
    plain = Where("none", "float32", "cpu", tied=False)
    assert choose(plain, head).row == "torch"  # nothing packs here
    avx2 = plain.found(packs=True, avx2_only=True, f32_kernel=True)
    assert choose(avx2, head).row == "f32-panels" and choose(avx2, biased).row == "onednn"
    assert choose(avx2.found(overrides={"f32-panels": "off"}), head).row == "onednn"
    assert choose(avx2.found(overrides={"torch-plain": "on"}), head).row == "torch-plain"
    avx512 = plain.found(packs=True, f32_kernel=True, f32_blocks_kernel=True)
    assert choose(avx512, head).row == "f32-mkl"
    assert choose(avx512.found(exact_blocks=True), head).row == "f32-blocks"
    tied = Where("none", "float32", "cpu", tied=True, packs=True)
    assert choose(tied, head).row == "tied-head-shared"  # the embedding was not mapped
    bf16 = Where("none", "bfloat16", "cpu", tied=False, packs=True, bf16_kernel=True)
    assert choose(bf16, head).row == "f32-head" and choose(bf16, biased).row == "onednn"
    assert choose(bf16, Layer("layers.0.mlp.down_proj", 32, 64, False)).row == "bf16-kernel"
    assert choose(Where("int8", "float32", "cpu", tied=True), head).row == "int8"


def test_the_decode_path_follows_the_layers_and_the_overrides():
    q = Where("int8", "float32", "cpu", tied=False)
    assert choose_decode_path(q, {"int8"}).row == "decode-layers-c"
    assert choose_decode_path(q.found(overrides={"decode-layers-c": "off"}), {"int8"}).row == (
        "fused-decode"
    )
    assert choose_decode_path(q.found(overrides={"fused-decode": "off"}), {"int8"}).row == "plain"
    exact = Where("none", "float32", "cpu", tied=False)
    assert choose_decode_path(exact, {"f32_blocks", "f32_panels"}).row == "decode-layers-c"
    assert choose_decode_path(exact, {"f32_panels", "onednn"}).row == "plain"  # one family only
    bf16 = Where("none", "bfloat16", "cpu", tied=False)
    assert choose_decode_path(bf16, {"bf16"}).row == "fused-decode"  # float32 rows only in C


@pytest.mark.skipif(load_native() is None, reason="no C compiler: no int8")
def test_the_loader_records_its_choices_and_honours_decode_overrides(tiny_llama_dir):
    def load(**overrides):
        model, _ = load_model(
            tiny_llama_dir,
            load_hf_config(tiny_llama_dir),
            torch.float32,
            "cpu",
            64,
            quantization="int8",
            kernel_overrides=overrides,
        )
        return model

    model = load()
    info = kernel_info(model)
    assert info["linear_layers"] == ["Int8Linear"] and set(info["linear_choices"]) == {
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
        "lm_head",
    }
    assert all(why.startswith("int8: ") for why in info["linear_choices"].values())
    assert model.decode_path is not None and model.decode_path.one_call
    assert info["decode_path"].startswith("decode-layers-c: ")
    assert not load(**{"decode-layers-c": "off"}).decode_path.one_call
    assert load(**{"fused-decode": "off"}).decode_path is None


def test_engine_info_names_the_choice_for_the_embedded_model(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "info", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    model, _ = load_model(model_dir, load_hf_config(model_dir), torch.float32, "cpu", 64)
    info = kernel_info(model)
    for kind, why in info["linear_choices"].items():
        assert f"  {kind:<13} {why}" in out.stdout
    assert f"decode path: {info['decode_path']}" in out.stdout
    assert "f32-blocks" in out.stdout and "torch-plain" in out.stdout  # the table itself
    bad = subprocess.run(
        [sys.executable, "-m", "engine.cli", "info", "--override", "nope=off"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown row 'nope'" in bad.stderr

"""The embedded GGUF's conversion (engine/model/gguf_convert.py) gives transformers' own conversion, file
for file and byte for byte; what it does not take goes to transformers, leaving nothing behind."""

from __future__ import annotations

import filecmp

import pytest

from engine.model.embedded import convert_here, convert_with_transformers, embedded_gguf_path
from engine.model.gguf_convert import hf_name

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


@pytest.fixture
def one_gguf_read(monkeypatch):
    """transformers parses the file with gguf's GGUFReader three times (6 s each on a Zen 1); one parse
    serves them all here, so the reference costs what its own work costs."""
    import gguf

    parsed: dict = {}
    original = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = original(path, *args, **kwargs)
        return parsed[key]

    monkeypatch.setattr(gguf, "GGUFReader", reader)


def test_the_embedded_gguf_converts_to_what_transformers_makes_of_it(tmp_path, one_gguf_read):
    gguf = embedded_gguf_path()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    assert convert_here(gguf, ours), (
        "the embedded model's kind of file is converted here, not by transformers"
    )
    convert_with_transformers(gguf, theirs)
    assert (
        sorted(p.name for p in ours.iterdir())
        == sorted(p.name for p in theirs.iterdir())
        == sorted(FILES)
    )
    for name in FILES:
        assert filecmp.cmp(ours / name, theirs / name, shallow=False), name


def test_a_file_it_cannot_read_is_left_to_transformers_with_nothing_written(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    out = tmp_path / "out"
    out.mkdir()
    assert not convert_here(broken, out)
    assert list(out.iterdir()) == []


def test_a_conversion_that_fails_halfway_leaves_nothing_and_says_so(tmp_path, monkeypatch, caplog):
    import torch
    from transformers import GenerationConfig

    from engine.model import gguf_convert

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(
        gguf_convert, "state_dict", lambda gguf, config: {"model.norm.weight": torch.ones(4)}
    )
    # after model.safetensors and config.json
    monkeypatch.setattr(GenerationConfig, "save_pretrained", fail)
    out = tmp_path / "out"
    out.mkdir()
    assert not convert_here(embedded_gguf_path(), out)
    assert list(out.iterdir()) == []
    # logged: on stderr outside pytest, whose log capture takes the records here
    assert "through transformers instead (RuntimeError: disk full)" in caplog.text


def test_tensor_names_outside_a_llama_are_not_guessed():
    assert hf_name("blk.3.attn_q.weight", 30) == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("output.weight", 30) == "lm_head.weight"
    for name in (
        "blk.30.attn_q.weight",
        "blk.0.attn_q.bias",
        "rope_freqs.weight",
        "blk.x.ffn_up.weight",
        "blk.0",
    ):
        assert hf_name(name, 30) is None, name

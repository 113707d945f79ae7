"""What Engine() no longer does at start, and the proof that skipping it changes nothing: config.json read
without transformers gives the same model config and rotary tables as AutoConfig; the user process encodes
with `tokenizers` alone, as transformers' tokenizer does, and imports neither torch nor transformers
until something needs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, save_tiny_model
from engine.model.config import model_config_from_hf, plain_config
from engine.model.rope import rotary_tables
from engine.tokenizer import PromptTokenizer

ROOT = Path(__file__).resolve().parent.parent


def _auto(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _same_model(model_dir: str) -> None:
    plain, auto = plain_config(model_dir), _auto(model_dir)
    assert plain is not None
    assert model_config_from_hf(plain, model_dir) == model_config_from_hf(auto, model_dir)
    for a, b in zip(
        rotary_tables(plain, 64, 512, torch.float32, "cpu"),
        rotary_tables(auto, 64, 512, torch.float32, "cpu"),
    ):
        assert torch.equal(a, b)


def test_plain_config_equals_autoconfig_on_the_embedded_model(model_dir):
    _same_model(model_dir)


def test_plain_config_equals_autoconfig_on_qwen2_and_defers_scaled_rope(
    tmp_path, model_dir, tiny_llama_dir
):
    save_tiny_model("qwen2", tmp_path, model_dir)
    _same_model(str(tmp_path))
    assert plain_config(tiny_llama_dir) is None  # llama3 rope scaling: AutoConfig's business


TEXTS = [
    *PROMPTS,
    "",
    " ",
    "  two  spaces\tand\ttabs\n\nnewlines\r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "émoji 🙂 ünïcödé ∑ 中文 日本語",
    "x" * 3000,
    "def f(x):\n    return {'a': [1, 2.5e-3]}\n",
    "\u200b\ufeffzero width",
]


@pytest.mark.parametrize("special", [True, False])
def test_prompt_tokenizer_encodes_as_transformers_does(model_dir, tokenizer, special):
    light = PromptTokenizer(model_dir)
    assert light._fast is not None  # the light path is the one under test
    for text in TEXTS:
        assert light.encode(text, add_special_tokens=special) == tokenizer.encode(
            text, add_special_tokens=special
        ), text
    assert len(light) == len(tokenizer)


def test_prompt_tokenizer_defers_to_transformers_where_the_config_rewrites_specials(
    tmp_path, model_dir
):
    import json
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(Path(model_dir) / name, tmp_path / name)
    original = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for change in (
        {"add_bos_token": True},
        {"add_prefix_space": True},
        {"tokenizer_class": "LlamaTokenizer"},
    ):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**original, **change}))
        assert PromptTokenizer(str(tmp_path))._fast is None, change
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(original))
    assert PromptTokenizer(str(tmp_path))._fast is not None


USER_PROCESS = """
import sys
from engine import Engine
if __name__ == "__main__":
    with Engine(max_total_tokens=512) as eng:
        a = eng.generate("The quick brown fox", {"max_new_tokens": 2, "temperature": 0})
        b = eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0})
        print("torch" in sys.modules, "transformers" in sys.modules)
        c = eng.generate(messages=[{"role": "user", "content": "hi"}], sampling_params={"max_new_tokens": 2})
        print("transformers" in sys.modules, eng.tokenizer is eng.tokenizer)
"""


def test_user_process_imports_neither_torch_nor_transformers_for_text(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(USER_PROCESS)
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False", "False", "True", "True"], res.stdout


def test_preload_tokenizer_loads_transformers_tokenizer_during_start(tiny_llama_dir):
    """engine serve's setting: transformers' tokenizer is there when Engine() returns (the server needs
    it at once), loaded while the children start instead of after them."""
    from engine import Engine

    with Engine(
        model_path=tiny_llama_dir, dtype="float32", max_total_tokens=256, preload_tokenizer=True
    ) as eng:
        assert eng._prompt_tokenizer._hf is not None
        messages = [{"role": "user", "content": "hi"}]
        out = eng.generate(messages=messages, sampling_params={"max_new_tokens": 2})
        text = eng.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert out["meta_info"]["prompt_tokens"] == len(
            eng.tokenizer.encode(text, add_special_tokens=False)
        )
    with pytest.raises(ValueError, match="preload_tokenizer must be True or False, got 'yes'"):
        Engine(preload_tokenizer="yes")

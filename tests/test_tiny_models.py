"""Parity on tiny random models saved as Hugging Face directories: Qwen2 (q/k/v bias, GQA, untied
embeddings) and Llama with llama3 RoPE scaling and tied embeddings."""

from __future__ import annotations

import pytest

from conftest import hf_greedy, save_tiny_model


@pytest.fixture(scope="module", params=["qwen2", "llama3-rope"])
def tiny(request, tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(request.param, folder, model_dir)
    return request.param, str(folder), model


def test_tiny_model_greedy_parity(tiny):
    from engine import Engine

    name, folder, model = tiny
    prompts = [[1, 2000 + 7 * i, 300 + i, 45, 9000 - i, 77] * (1 + i) for i in range(6)]
    expected = [hf_greedy(model, ids, 24) for ids in prompts]
    assert all(len(set(e)) > 5 for e in expected), (
        "the reference degenerated; the comparison would be weak"
    )
    with Engine(model_path=folder, dtype="float32", max_total_tokens=4096) as eng:
        assert eng.server_info["architecture"] == (
            "Qwen2ForCausalLM" if name == "qwen2" else "LlamaForCausalLM"
        )
        outs = eng.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0}
        )
        single = eng.generate(
            input_ids=prompts[-1], sampling_params={"max_new_tokens": 24, "temperature": 0}
        )
    assert [o["output_ids"] for o in outs] == expected
    assert single["output_ids"] == expected[-1]

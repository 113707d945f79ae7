"""Greedy float32 outputs token-identical to transformers generate on the embedded SmolLM2."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import PROMPTS, hf_greedy_checked

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[list[int]]:
    ids = []
    for i, p in enumerate(PROMPTS):
        if i % 2 == 0:  # half plain text, half through the chat template
            ids.append(tokenizer.encode(p))
        else:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(scope="module")
def reference(hf_model, engine, chat_ids) -> list[list[int]]:
    """transformers generate's greedy tokens; found by checking the engine's in one pass (conftest)."""
    candidates = [
        o["output_ids"] for o in engine.generate(input_ids=chat_ids, sampling_params=GREEDY)
    ]
    engine.flush_cache()  # the tests below start from an empty prefix cache, as they did before
    return [hf_greedy_checked(hf_model, ids, c, NEW_TOKENS) for ids, c in zip(chat_ids, candidates)]


def test_one_at_a_time(engine, chat_ids, reference):
    for ids, expected in zip(chat_ids, reference):
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert out["output_ids"] == expected
        assert out["meta_info"]["completion_tokens"] == len(expected)


def test_staggered_batch(engine, chat_ids, reference):
    """Requests arrive while others decode, so batches change composition mid-run."""
    results: dict[int, dict] = {}

    def submit(i: int) -> None:
        time.sleep(0.15 * i)
        results[i] = engine.generate(input_ids=chat_ids[i], sampling_params=GREEDY)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(chat_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, expected in enumerate(reference):
        assert results[i]["output_ids"] == expected, f"prompt {i} diverged"


def test_batch_call_matches(engine, chat_ids, reference):
    outs = engine.generate(input_ids=chat_ids, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference

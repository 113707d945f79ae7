"""Shared fixtures: one float32 engine on the embedded SmolLM2 for the whole session, and its HF reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engine.bench.prompts import PARITY_PROMPTS  # noqa: E402

PROMPTS = list(PARITY_PROMPTS)


@pytest.fixture(scope="session")
def engine():
    from engine import Engine

    # the tests use engine.tokenizer
    eng = Engine(dtype="float32", max_total_tokens=16384, preload_tokenizer=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def eng():
    """A module's own float32 engine on one thread: beside the transformers references and other
    engines, torch's threads would spend longer waiting on each other than computing."""
    from engine import Engine

    with Engine(dtype="float32", max_total_tokens=8192, num_threads=1, preload_tokenizer=True) as e:
        yield e


@pytest.fixture(scope="module")
def one_thread_references():
    """torch on one thread in this process for a module's transformers references."""
    from hf_reference import one_thread

    with one_thread():
        yield


@pytest.fixture(scope="session")
def model_dir(engine) -> str:
    return engine.model_dir


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate for one prompt, no padding."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return out[0, len(ids) :].tolist()


def hf_greedy_checked(
    model, ids: list[int], candidate: list[int], max_new_tokens: int, margin: float = 1e-3
) -> list[int]:
    """What hf_greedy(model, ids, max_new_tokens) returns, found by checking a candidate (the engine's
    output) in one forward pass over ids + candidate: at every position transformers' argmax must be the
    candidate's token, ahead of the runner-up by at least margin, the candidate must end where generate
    would (max_new_tokens, or its first EOS), and the generation config must have no logits processor
    that greedy generate would apply (a repetition penalty, suppressed tokens, ...). generate's
    step-by-step logits differ from one pass's by at most 7e-5 on the parity prompts (Zen 1, float32):
    the margin is over ten times that. Anything short of that, and transformers' own generate decides.
    One pass is 8 s where generate is 54 s for test_prefix_cache's prompts on a 2-core AMD EPYC Zen 1."""
    import torch

    config = model.generation_config
    eos = config.eos_token_id
    eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    processors = (
        config.repetition_penalty not in (None, 1.0)
        or config.suppress_tokens
        or config.begin_suppress_tokens
        or config.bad_words_ids
        or config.sequence_bias
        or config.min_length
        or config.min_new_tokens
        or config.no_repeat_ngram_size
        or config.forced_bos_token_id is not None
        or config.forced_eos_token_id is not None
    )
    ends = len(candidate) == max_new_tokens or (
        0 < len(candidate) < max_new_tokens and candidate[-1] in eos
    )
    if ends and not processors and not eos.intersection(candidate[:-1]):
        with torch.inference_mode():
            logits = model(torch.tensor([ids + candidate])).logits[
                0, len(ids) - 1 : len(ids) + len(candidate) - 1
            ]
        top2 = logits.topk(2, dim=-1)
        if top2.indices[:, 0].tolist() == candidate and bool(
            (top2.values[:, 0] - top2.values[:, 1] >= margin).all()
        ):
            return list(candidate)
    return hf_greedy(model, ids, max_new_tokens)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def _tiny_config(kind: str):
    if kind == "qwen2":  # q/k/v bias, GQA, untied embeddings
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            initializer_range=0.2,
            eos_token_id=2,
            bos_token_id=1,
            rope_theta=10000.0,
        )
    from transformers import LlamaConfig  # llama3 RoPE scaling, MQA, tied embeddings

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )


def save_tiny_model(kind: str, folder, tokenizer_dir: str):
    """A tiny random model saved as a Hugging Face directory, with the SmolLM2 tokenizer beside it."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        _tiny_config(kind), dtype=torch.float32, attn_implementation="sdpa"
    )
    if kind == "qwen2":  # random biases, so the bias path is really exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, Path(folder) / name)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, model_dir) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama3-rope", folder, model_dir)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_scheduler(tiny_llama_dir):
    """A Scheduler in the test process on the tiny Llama, real sockets both sides (test_scheduler_steps.InProcess)."""
    from test_scheduler_steps import InProcess

    run = InProcess(tiny_llama_dir, max_total_tokens=512, max_running_requests=4)
    yield run
    run.close()


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, model_dir):
    """One engine on a tiny Llama with head_dim 40, short context, default backend (tests/tiny_engine.py)."""
    from engine import Engine
    from tiny_engine import CONTEXT, save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama-hd40")
    save_tiny_llama(folder, model_dir)
    eng = Engine(
        model_path=str(folder), dtype="float32", max_total_tokens=2048, context_length=CONTEXT
    )
    yield eng
    eng.shutdown()

"""Beam search in the scheduler: token parity with transformers' beam search in float32, and the
bookkeeping around it (memory bound, mixing with ordinary requests, refusals, aborts, failures)."""

from __future__ import annotations

import threading

import pytest

from conftest import PROMPTS


def _prompt_ids(tokenizer, i: int) -> list[int]:
    return tokenizer.encode(PROMPTS[i])


def hf_beam_search(model, ids: list[int], k: int, n: int, r: int = 1, length_penalty: float = 1.0,
                   early_stopping=False, processors=(), **kwargs) -> list[tuple[list[int], float]]:  # fmt: skip
    """transformers' generate(num_beams=k): the r best (generated ids, sequence score), no padding inside."""
    import torch
    from transformers import LogitsProcessorList

    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
            num_beams=k, num_return_sequences=r, length_penalty=length_penalty, early_stopping=early_stopping,
            do_sample=False, pad_token_id=eos, output_scores=True, output_logits=True, return_dict_in_generate=True,
            logits_processor=LogitsProcessorList(processors), **kwargs,
        )  # fmt: skip
    seqs = out.sequences[:, len(ids) :].tolist()
    if k == 1:  # transformers runs greedy search: the score from its raw logits, as beam search keeps it
        steps = torch.stack([torch.log_softmax(x[0], -1) for x in out.logits])
        total = float(steps.gather(1, torch.tensor(seqs[0])[: len(steps), None]).sum())
        return [(seqs[0], total / len(steps) ** length_penalty)]
    return [(s, float(score)) for s, score in zip(seqs, out.sequences_scores.tolist())]


def _same(ours: list[dict], ref: list[tuple[list[int], float]], eos: int) -> None:
    assert len(ours) == len(ref)
    for h, (ids, score) in zip(ours, ref):
        padded = h["output_ids"] + [eos] * (len(ids) - len(h["output_ids"]))
        assert padded == ids, (h["output_ids"], ids)
        assert h["score"] == pytest.approx(score, abs=1e-4)


class ForTransformers:
    """One of our custom logit processors, given to transformers through `logits_processor`."""

    def __init__(self, name: str, params: dict, prompt_len: int) -> None:
        from engine.sampling.processors import get_logit_processor

        self.proc = get_logit_processor(name)()
        self.params = params
        self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
        import torch

        from engine.sampling.processors import ProcessorBatch

        out = input_ids[:, self.prompt_len :]
        rows = out.shape[0]
        batch = ProcessorBatch([self.params] * rows, out.tolist(), torch.full((rows,), out.shape[1]), list(range(rows)))
        return self.proc(scores, batch)


CASES = [  # (prompt, K, N, R, length_penalty, early_stopping, extra sampling parameters)
    (0, 1, 12, 1, 1.0, False, {}),
    (1, 2, 12, 2, 1.0, False, {}),
    (2, 4, 16, 3, 1.0, True, {}),
    (3, 8, 12, 4, 1.0, False, {}),
    (0, 4, 24, 2, 0.6, "never", {}),
    (5, 4, 12, 2, 2.0, False, {}),
    (6, 4, 16, 2, 1.0, False, {"repetition_penalty": 1.3}),
    (4, 3, 12, 3, -0.5, True, {"min_new_tokens": 4}),
]


@pytest.mark.parametrize("case", CASES, ids=[f"K{c[1]}-N{c[2]}-R{c[3]}-lp{c[4]}-es{c[5]}-{'-'.join(c[6]) or 'plain'}" for c in CASES])
def test_matches_transformers(engine, hf_model, tokenizer, case):
    prompt, k, n, r, lp, es, extra = case
    ids = _prompt_ids(tokenizer, prompt)
    ours = engine.beam_search(input_ids=ids, beam_width=k, max_new_tokens=n, num_return_sequences=r,
                              length_penalty=lp, early_stopping=es, **extra)  # fmt: skip
    hf_extra = dict(extra)
    if "min_new_tokens" in hf_extra:
        hf_extra["min_new_tokens"] = extra["min_new_tokens"]
    ref = hf_beam_search(hf_model, ids, k, n, r, lp, es, **hf_extra)
    _same(ours["hypotheses"], ref, tokenizer.eos_token_id)
    assert ours["meta_info"]["beam_width"] == k and ours["meta_info"]["steps"] >= 1
    assert all(h["text"] == tokenizer.decode(h["output_ids"], skip_special_tokens=True) for h in ours["hypotheses"])


@pytest.mark.parametrize("name,params", [
    ("disallowed_tokens", {"token_ids": [7042, 30, 28]}),
    ("force_token_after", {"token_id": 2, "after": 6}),
])  # fmt: skip
def test_custom_logit_processor_matches_transformers(engine, hf_model, tokenizer, name, params):
    ids = _prompt_ids(tokenizer, 0)
    ours = engine.beam_search(input_ids=ids, beam_width=4, max_new_tokens=12, num_return_sequences=2,
                              custom_logit_processor=name, custom_params=params)  # fmt: skip
    ref = hf_beam_search(hf_model, ids, 4, 12, 2, processors=[ForTransformers(name, params, len(ids))])
    _same(ours["hypotheses"], ref, tokenizer.eos_token_id)
    if name == "disallowed_tokens":
        assert not set(params["token_ids"]) & {t for h in ours["hypotheses"] for t in h["output_ids"]}

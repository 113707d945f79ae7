"""return_hidden_states against transformers in float32 on the embedded SmolLM2: prompt and generated
rows, several layers and points, requests with and without it batched together, with and without a
prefix-cache hit, with n > 1, grammars, chunked prefill and retraction; bad requests refused up front."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import PROMPTS, hf_greedy_checked
from engine import Engine
from helpers import engine_idle
from hf_reference import greedy_in_pass, hf_pass, row_error, steered


pytestmark = pytest.mark.usefixtures("one_thread_references")


NEW = 8
LAYERS = 30  # SmolLM2-135M's decoder layers
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
# float32 against float32, the same sums in other orders: each row within 5e-5 of its norm (observed up
# to 2e-5; transformers' own float32 is up to 1.2e-5 from float64); a wrong row is off by 0.08 or more
TOL = 5e-5


def together(eng: Engine, calls: list[dict]) -> list:
    """Submit every call at once (async_generate), so their requests run in the same batches."""

    async def run() -> list:
        return await asyncio.gather(*(eng.async_generate(**c) for c in calls))

    return asyncio.run(run())


def call(ids: list[int], hidden=None, params: dict | None = None) -> dict:
    return dict(input_ids=ids, sampling_params=params or GREEDY, return_hidden_states=hidden)


def chat(tokenizer, text: str) -> list[int]:
    """text as the user's turn of a chat, ready for the assistant's."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(eng) -> list[list[int]]:
    """Prompts of different lengths (4 to 40 tokens): plain ones and chat-templated ones."""
    return [
        chat(eng.tokenizer, p) if i % 3 == 2 else eng.tokenizer.encode(p)
        for i, p in enumerate(PROMPTS)
    ]


SYSTEM = (
    "You are a careful assistant. Answer briefly and truthfully. If you do not know, say so. "
    "Prefer plain words to jargon, and give one example when it helps the reader understand. "
)


@pytest.fixture(scope="module")
def long_prompts(eng) -> list[list[int]]:
    """Six prompts behind a shared system text: 43 to 59 tokens, more than one chunk of 16, and no end
    of text in their first greedy tokens."""
    return [eng.tokenizer.encode(SYSTEM + p) for p in PROMPTS[2:]]


def reference(hf_model, ids: list[int], out: dict, point: str = "resid_post"):
    """transformers' pass over the prompt and out's tokens: (every layer's states at point, logits)."""
    return hf_pass(hf_model, ids + out["output_ids"], list(range(LAYERS)), point)


def check_states(
    hf_model, ids, out, layers, tokens, point="resid_post", greedy=False, ref=None
) -> None:
    """out's hidden states are transformers' at those layers, rows and point, within TOL; with greedy,
    its tokens are transformers' greedy ones too (checked in the same pass). ref: reference()'s."""
    hs = out["meta_info"]["hidden_states"]
    normalized = [i % LAYERS for i in layers]
    assert hs["layers"] == normalized and hs["point"] == point
    gen = out["output_ids"]
    p, n = len(ids), len(gen)
    states, logits = ref or reference(hf_model, ids, out, point)
    states = states[normalized]  # [layers, p + n, hidden]
    if greedy and not greedy_in_pass(logits, p, gen):
        assert gen == hf_greedy_checked(hf_model, ids, gen, n)
    want_prompt = tokens in ("last", "prompt", "all")
    want_generated = tokens in ("generated", "all")
    assert ("prompt" in hs) == want_prompt and ("generated" in hs) == want_generated, hs.keys()
    if want_prompt:
        rows = states[:, p - 1 : p] if tokens == "last" else states[:, :p]
        assert hs["prompt"].dtype == torch.float32
        diff = row_error(hs["prompt"], rows)
        assert diff <= TOL, f"prompt rows of layers {normalized}: error {diff:.2e} of the row norm"
    if want_generated:
        # row k: the state at the position that predicted generated token k
        rows = states[:, p - 1 : p - 1 + n]
        assert hs["generated"].dtype == torch.float32
        diff = row_error(hs["generated"], rows)
        assert diff <= TOL, (
            f"generated rows of layers {normalized}: error {diff:.2e} of the row norm"
        )


MIXED = [  # (prompt index, return_hidden_states, layers it normalizes to, tokens)
    (0, {"layers": [0, 14, -1], "tokens": "all"}, [0, 14, 29], "all"),
    (1, None, None, None),
    (2, True, [29], "last"),
    (3, {"layers": [14, 0], "tokens": "generated"}, [14, 0], "generated"),
    (4, {"layers": [29, 5], "tokens": "prompt"}, [29, 5], "prompt"),
    (7, {"layers": [0, 29], "tokens": "last"}, [0, 29], "last"),
]


def test_mixed_batch_matches_transformers(eng, hf_model, prompts):
    """Requests with and without hidden states, every tokens mode, different prompt lengths, all at
    once from an empty cache: each gets transformers' rows and transformers' greedy tokens."""
    eng.flush_cache()
    outs = together(eng, [call(prompts[i], hidden) for i, hidden, *_ in MIXED])
    assert len({len(prompts[i]) for i, *_ in MIXED}) >= 4  # the lengths differ
    for (i, hidden, layers, tokens), out in zip(MIXED, outs):
        ids, gen = prompts[i], out["output_ids"]
        if hidden is None:
            assert "hidden_states" not in out["meta_info"]
            assert gen == hf_greedy_checked(hf_model, ids, gen, NEW)
        else:
            check_states(hf_model, ids, out, layers, tokens, greedy=True)
    assert engine_idle(eng.get_stats())


def test_attention_and_mlp_outputs_match_transformers_hooks(eng, hf_model, prompts):
    """attn_out is self_attn's output (after o_proj), mlp_out the MLP's, at prompt and generated rows,
    each beside a request of the other point and one with none."""
    layers = [0, 15, -1]
    attn, plain, mlp = together(
        eng,
        [
            call(prompts[6], {"layers": layers, "tokens": "all", "point": "attn_out"}),
            call(prompts[2]),
            call(prompts[4], {"layers": layers, "tokens": "all", "point": "mlp_out"}),
        ],
    )
    check_states(hf_model, prompts[6], attn, layers, "all", "attn_out", greedy=True)
    check_states(hf_model, prompts[4], mlp, layers, "all", "mlp_out", greedy=True)
    assert "hidden_states" not in plain["meta_info"]


def test_prefix_cache_hit(eng, hf_model, prompts):
    """ "last" and "generated" are exact with the prompt served from the cache (the last prompt token is
    computed); "prompt" after a cached run still returns every prompt row, recomputed and exact."""
    ids = prompts[7]
    eng.flush_cache()
    first = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    ref = reference(hf_model, ids, first)
    if not greedy_in_pass(ref[1], len(ids), first["output_ids"]):
        assert first["output_ids"] == hf_greedy_checked(hf_model, ids, first["output_ids"], NEW)
    last, generated = together(
        eng,
        [
            call(ids, {"layers": [0, 14, 29], "tokens": "last"}),
            call(ids, {"layers": [29, 3], "tokens": "generated"}),
        ],
    )
    for out, layers, tokens in ((last, [0, 14, 29], "last"), (generated, [29, 3], "generated")):
        assert out["meta_info"]["cached_tokens"] == len(ids) - 1, out["meta_info"]
        assert out["output_ids"] == first["output_ids"]
        check_states(hf_model, ids, out, layers, tokens, ref=ref)

    prompt = eng.generate(
        input_ids=ids,
        sampling_params=GREEDY,
        return_hidden_states={"layers": [0, 29], "tokens": "all"},
    )
    assert prompt["output_ids"] == first["output_ids"]
    assert prompt["meta_info"]["cached_tokens"] == 0  # prompt rows are computed, not cached
    assert prompt["meta_info"]["hidden_states"]["prompt"].shape == (2, len(ids), 576)
    check_states(hf_model, ids, prompt, [0, 29], "all", ref=ref)
    # the cache still serves requests that do not ask for prompt rows
    again = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == first["output_ids"]


def test_stream_carries_them_on_its_last_chunk(eng, hf_model, prompts):
    """stream=True: only the final chunk carries the hidden states, of every token streamed."""
    ids = prompts[6]
    chunks = list(
        eng.generate(
            input_ids=ids,
            sampling_params=GREEDY,
            stream=True,
            return_hidden_states={"layers": [2, 29], "tokens": "all"},
        )
    )
    assert all("hidden_states" not in c["meta_info"] for c in chunks[:-1])
    last = dict(chunks[-1], output_ids=[t for c in chunks for t in c["output_ids"]])
    assert len(last["output_ids"]) == NEW
    check_states(hf_model, ids, last, [2, 29], "all", greedy=True)


def test_n_copies_each_get_their_own_rows(eng, hf_model, prompts):
    """n > 1: every sampled copy returns the prompt rows and the rows of its own generated tokens."""
    ids = prompts[5]
    params = {"n": 2, "max_new_tokens": NEW, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    hidden = {"layers": [0, 29], "tokens": "all"}
    outs = eng.generate(input_ids=ids, sampling_params=params, return_hidden_states=hidden)
    assert len(outs) == 2
    for out in outs:
        check_states(hf_model, ids, out, [0, 29], "all")


def test_grammar_requests(eng, hf_model, prompts):
    """A json_schema and a regex request: the output keeps to its grammar, the rows are exact."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    json_params = {"max_new_tokens": 24, "temperature": 0, "json_schema": schema}
    regex_params = {"max_new_tokens": 16, "temperature": 0, "regex": "(yes|no), [0-9]{3}"}
    js, rx = together(
        eng,
        [
            call(prompts[0], {"layers": [0, 29], "tokens": "all"}, json_params),
            call(prompts[1], {"layers": [10], "tokens": "generated"}, regex_params),
        ],
    )
    import json
    import re

    text = js["text"]
    if js["meta_info"]["finish_reason"]["type"] == "stop":
        assert set(json.loads(text)) == {"name", "age"}
    assert re.fullmatch("(yes|no), [0-9]{3}", rx["text"]), rx["text"]
    check_states(hf_model, prompts[0], js, [0, 29], "all")
    check_states(hf_model, prompts[1], rx, [10], "generated")


def first_match(eng: Engine, out: dict) -> tuple[str, int]:
    """A stop string for out's text, a word its greedy run reaches after a few tokens, and how many
    tokens it takes to reach it."""
    ids = out["output_ids"]
    for k in range(3, len(ids) - 2):
        word = eng.tokenizer.decode(ids[k - 1 : k]).strip()
        text = eng.tokenizer.decode(ids[:k])
        if len(word) >= 2 and text.find(word) == len(text) - len(word):
            return word, k
    raise AssertionError(f"no word to stop at in {eng.tokenizer.decode(ids)!r}")


def test_stop_strings_cut_hidden_states_at_the_match(eng, hf_model, prompts):
    """A request a stop string ends gets the rows of the tokens up to the match, whether the match
    ends it before the scheduler does (its states come later) or on the scheduler's last token."""
    ids = prompts[6]
    params = dict(GREEDY, max_new_tokens=16)
    whole = eng.generate(input_ids=ids, sampling_params=params)
    word, k = first_match(eng, whole)
    hidden = {"layers": [0, 29], "tokens": "all"}
    early, on_last, plain = together(
        eng,
        [
            call(ids, hidden, dict(params, stop=[word])),
            call(
                ids,
                {"layers": [14], "tokens": "generated"},
                dict(params, stop=[word], max_new_tokens=k),
            ),
            call(prompts[2], None, params),
        ],
    )
    for out, layers, tokens in ((early, [0, 29], "all"), (on_last, [14], "generated")):
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": word}, meta["finish_reason"]
        assert out["output_ids"] == whole["output_ids"][:k]
        assert meta["completion_tokens"] == k
        assert meta["hidden_states"]["generated"].shape[1] == k
        assert word not in out["text"]  # the stop string is the text's first
        check_states(hf_model, ids, out, layers, tokens)
    assert plain["meta_info"]["completion_tokens"] == 16
    chunks = list(
        eng.generate(
            input_ids=ids,
            sampling_params=dict(params, stop=[word]),
            stream=True,
            return_hidden_states=hidden,
        )
    )
    assert all("hidden_states" not in c["meta_info"] for c in chunks[:-1])
    last = dict(chunks[-1], output_ids=[t for c in chunks for t in c["output_ids"]])
    assert last["output_ids"] == whole["output_ids"][:k]
    assert last["meta_info"]["finish_reason"]["type"] == "stop"
    check_states(hf_model, ids, last, [0, 29], "all")
    stats = eng.get_stats()
    assert engine_idle(stats)
    assert stats["tracked"]["detokenizer"]["awaiting_meta"] == 0


@pytest.mark.parametrize(
    "hidden, params, field",
    [
        ({"layers": [30]}, GREEDY, "return_hidden_states.layers"),
        ({"layers": [-31]}, GREEDY, "return_hidden_states.layers"),
        ({"layers": []}, GREEDY, "return_hidden_states.layers"),
        ({"layers": [0, 0]}, GREEDY, "return_hidden_states.layers"),
        ({"tokens": "every"}, GREEDY, "return_hidden_states.tokens"),
        ({"point": "q_proj"}, GREEDY, "return_hidden_states.point"),
        ("yes", GREEDY, "return_hidden_states"),
        (  # 30 layers x (prompt + 1000) rows x 576 x 4 bytes is over the default 64 MiB
            {"layers": list(range(30)), "tokens": "all"},
            {"max_new_tokens": 1000, "temperature": 0},
            "max_hidden_state_bytes",
        ),
    ],
)
def test_bad_requests_are_refused_up_front(eng, prompts, hidden, params, field):
    before = eng.get_stats()
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        eng.generate(input_ids=prompts[0], sampling_params=params, return_hidden_states=hidden)
    after = eng.get_stats()
    assert after["prompt_tokens"] == before["prompt_tokens"]  # nothing was queued
    out = eng.generate(
        input_ids=prompts[0], sampling_params={"max_new_tokens": 1}, return_hidden_states=True
    )
    assert out["meta_info"]["hidden_states"]["prompt"].shape == (1, 1, 576)


def test_size_bound_is_checked_per_request(eng, prompts):
    """The bound counts the worst case: 30 layers x "generated" fit with 16 new tokens, not with 1000."""
    hidden = {"layers": list(range(30)), "tokens": "generated"}
    out = eng.generate(
        input_ids=prompts[3],
        sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        return_hidden_states=hidden,
    )
    assert out["meta_info"]["hidden_states"]["generated"].shape == (30, 16, 576)
    with pytest.raises(ValueError, match="return_hidden_states"):
        eng.generate(
            input_ids=prompts[3],
            sampling_params={"max_new_tokens": 1000, "temperature": 0},
            return_hidden_states=hidden,
        )


LONGEST_NEW = 16
LONGEST_PROMPT = 59  # the longest of long_prompts


@pytest.fixture(scope="module")
def tight():
    """Chunks of 16 tokens and a pool for about two requests: every prompt is chunked, and a low
    estimate of new tokens admits more than fit, so decode has to retract requests."""
    with Engine(
        dtype="float32",
        max_total_tokens=2 * (LONGEST_PROMPT + LONGEST_NEW) + 20,
        max_running_requests=8,
        chunked_prefill_size=16,
        init_new_token_ratio=0.05,
        num_threads=1,
    ) as eng:
        yield eng


def test_chunked_prefill_and_retraction(tight, hf_model, long_prompts):
    """Hidden states (prompt rows over several chunks, generated rows across a retraction) and steering,
    on an engine that chunks every prompt and must retract (each request asks for one or the other,
    so whichever is retracted is tapped): all exact against transformers, every row returned once."""
    params = {"max_new_tokens": LONGEST_NEW, "temperature": 0, "ignore_eos": True}
    assert max(len(ids) for ids in long_prompts) == LONGEST_PROMPT
    vector = torch.randn(576, generator=torch.Generator().manual_seed(1))
    vector = vector * (60.0 / vector.norm())
    steering = [{"layer": 10, "vector": vector.tolist(), "scale": 1.0}]
    plan = [  # (return_hidden_states, steering), one per prompt
        ({"layers": [0, 29], "tokens": "all"}, None),
        ({"layers": [14], "tokens": "generated"}, None),
        (None, steering),
        ({"layers": [0, 29], "tokens": "prompt"}, None),
        ({"layers": [7], "tokens": "last"}, None),
        ({"layers": [-1], "tokens": "all"}, steering),
    ]
    before = tight.get_stats()
    outs = together(
        tight,
        [
            dict(input_ids=ids, sampling_params=params, return_hidden_states=h, steering=s)
            for ids, (h, s) in zip(long_prompts, plan)
        ],
    )
    after = tight.get_stats()
    assert after["chunked_prefill_steps"] > before["chunked_prefill_steps"], after
    assert after["retracted_requests"] > before["retracted_requests"], after
    for ids, (hidden, steer), out in zip(long_prompts, plan, outs):
        gen = out["output_ids"]
        assert len(gen) == LONGEST_NEW
        with steered(hf_model, [(10, vector, 1.0)] if steer else []):
            if hidden is None:
                assert gen == hf_greedy_checked(hf_model, ids, gen, LONGEST_NEW)
            else:
                check_states(hf_model, ids, out, hidden["layers"], hidden["tokens"], greedy=True)
    assert engine_idle(tight.get_stats())


def test_beam_search_over_a_chunked_prompt(tight, hf_model, long_prompts):
    """A beam search whose prompt is prefilled in chunks of 16: its prompt rows, gathered across the
    chunks, and each hypothesis's own generated rows are transformers'."""
    ids = long_prompts[-1]
    before = tight.get_stats()
    out = tight.beam_search(
        input_ids=ids,
        beam_width=2,
        num_return_sequences=2,
        max_new_tokens=6,
        return_hidden_states={"layers": [0, 29], "tokens": "all"},
    )
    assert tight.get_stats()["chunked_prefill_steps"] > before["chunked_prefill_steps"]
    hs, p = out["meta_info"]["hidden_states"], len(ids)
    assert len(hs["generated"]) == len(out["hypotheses"]) == 2
    for hyp, rows in zip(out["hypotheses"], hs["generated"]):
        n = len(hyp["output_ids"])
        states, _ = hf_pass(hf_model, ids + hyp["output_ids"], [0, 29], "resid_post")
        assert rows.shape == (2, n, 576)
        assert row_error(rows, states[:, p - 1 : p - 1 + n]) <= TOL
        assert row_error(hs["prompt"], states[:, :p]) <= TOL

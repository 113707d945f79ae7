"""The request API on the real engine (SmolLM2, float32): greedy equivalents, seeds, logprobs against
transformers, penalties against transformers' generate, stop strings, min_new_tokens, n, streaming,
async, abort and custom logit processors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from conftest import PROMPTS, hf_greedy
from helpers import engine_idle


def test_top_k_1_and_temperature_0_are_greedy(engine, hf_model, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])
    expected = hf_greedy(hf_model, ids, 16)
    for params in (
        {"temperature": 0},
        {"top_k": 1, "temperature": 1.3},
        {"temperature": 1e-6, "top_p": 0.5},
    ):
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, **params})
        assert out["output_ids"] == expected, params


def test_seeded_request_is_reproducible_in_any_batch(engine):
    seeded = {"max_new_tokens": 24, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    alone = engine.generate(PROMPTS[5], seeded)["output_ids"]
    batch = engine.generate(
        [PROMPTS[0], PROMPTS[5], PROMPTS[2]],
        [
            {"max_new_tokens": 30, "temperature": 0.9},
            seeded,
            {"max_new_tokens": 8, "temperature": 0},
        ],
    )
    assert batch[1]["output_ids"] == alone
    other = engine.generate(PROMPTS[5], {**seeded, "seed": 43})["output_ids"]
    assert other != alone


def test_logprobs_match_transformers(engine, hf_model, tokenizer):
    ids = tokenizer.encode(PROMPTS[7])
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=5,
        logprob_start_len=0,
    )
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
    # output tokens: position len(ids) - 1 + i predicts output i
    got = meta["output_token_logprobs"]
    assert [t for _, t, _ in got] == out["output_ids"]
    for i, (lp, token, _) in enumerate(got):
        assert lp == pytest.approx(ref[len(ids) - 1 + i, token].item(), abs=1e-4)
    for i, top in enumerate(meta["output_top_logprobs"]):
        values, indices = ref[len(ids) - 1 + i].topk(5)
        assert [t for _, t, _ in top] == indices.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(values.tolist(), abs=1e-4)
    # prompt tokens: the first has none; token j is predicted at position j - 1
    prompt_lps = meta["input_token_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0][0] is None
    assert [t for _, t, _ in prompt_lps] == ids
    for j in range(1, len(ids)):
        assert prompt_lps[j][0] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 5


def test_prompt_logprobs_from_a_start_position_bypass_the_cache(engine, tokenizer):
    ids = tokenizer.encode(PROMPTS[3] * 3)
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # now cached
    start = 10
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=start,
    )
    lps = out["meta_info"]["input_token_logprobs"]
    assert len(lps) == len(ids) - start and all(lp is not None for lp, _, _ in lps)
    assert out["meta_info"]["cached_tokens"] <= start - 1


def test_repetition_penalty_matches_transformers_generate(engine, hf_model, tokenizer):
    ids = tokenizer.encode("Repeat after me: apple apple apple apple")
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
            repetition_penalty=1.5,
            pad_token_id=hf_model.generation_config.eos_token_id,
        )[0, len(ids) :].tolist()
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 20, "temperature": 0, "repetition_penalty": 1.5},
    )
    assert out["output_ids"] == ref  # EOS included, as transformers gives it


def test_stop_strings_spanning_tokens(engine, tokenizer):
    prompt = PROMPTS[7]
    base = engine.generate(prompt, {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True})
    text, ids = base["text"], base["output_ids"]
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # a stop string from the middle of token k to the middle of token k + span - 1
    for span in (
        2,
        3,
    ):
        k = next(
            i
            for i in range(2, len(ids) - span)
            if len(tokenizer.decode([ids[i]])) >= 2
            and len(tokenizer.decode([ids[i + span - 1]])) >= 2
        )
        start = len(pieces[k - 1]) + 1
        end = len(pieces[k + span - 2]) + 1
        stop = text[start:end]
        assert text.find(stop) == start, "pick a stop string whose first occurrence is here"
        out = engine.generate(
            prompt,
            {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True, "stop": [stop, "zzzz"]},
        )
        assert out["text"] == text[:start]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        # stopped promptly
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] <= k + span + 2
    assert engine_idle(engine.get_stats())


def test_min_new_tokens_suppresses_eos(engine, tokenizer):
    messages = [{"role": "user", "content": "Say only the word yes."}]
    short = engine.generate(
        messages=messages, sampling_params={"max_new_tokens": 40, "temperature": 0}
    )
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    n_short = len(short["output_ids"])
    longer = engine.generate(
        messages=messages,
        sampling_params={"max_new_tokens": 40, "temperature": 0, "min_new_tokens": n_short + 5},
    )
    assert len(longer["output_ids"]) >= n_short + 5
    eos = set(engine.server_info["eos_token_ids"])
    assert not eos & set(longer["output_ids"][: n_short + 4])


def test_n_samples_share_one_prefill(engine, tokenizer):
    engine.flush_cache()
    prompt = "Write one sentence about a lighthouse keeper and the storm that changed everything for them."
    n_prompt = len(tokenizer.encode(prompt))
    before = engine.get_stats()
    outs = engine.generate(prompt, {"n": 4, "max_new_tokens": 12, "temperature": 1.0, "seed": 7})
    after = engine.get_stats()
    assert len(outs) == 4 and len({o["meta_info"]["id"] for o in outs}) == 4
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0] + [n_prompt - 1] * 3
    # one prefill, then one token each
    assert after["prefill_tokens"] - before["prefill_tokens"] == n_prompt + 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # seeds seed, seed+1, ... differ
    again = engine.generate(prompt, {"n": 4, "max_new_tokens": 12, "temperature": 1.0, "seed": 7})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]


def test_streaming_equals_non_streaming(engine):
    params = [
        {"max_new_tokens": 40, "temperature": 0},
        {"max_new_tokens": 20, "temperature": 0, "stop": ["."]},
    ]
    prompts = [PROMPTS[7], PROMPTS[5]]
    full = engine.generate(prompts, params)
    texts, ids, finals = ["", ""], [[], []], [None, None]
    for chunk in engine.generate(prompts, params, stream=True):
        i = chunk["index"]
        texts[i] += chunk["text"]
        ids[i] += chunk["output_ids"]
        if chunk["meta_info"]["finish_reason"] is not None:
            finals[i] = chunk["meta_info"]
    assert texts == [o["text"] for o in full]
    assert ids == [o["output_ids"] for o in full]
    assert [f["finish_reason"] for f in finals] == [o["meta_info"]["finish_reason"] for o in full]


def test_async_generate_and_async_stream(engine):
    params = {"max_new_tokens": 24, "temperature": 0}
    expected = engine.generate(PROMPTS[0], params)

    async def main():
        one = await engine.async_generate(PROMPTS[0], params)
        many = await asyncio.gather(*(engine.async_generate(PROMPTS[0], params) for _ in range(3)))
        text = ""
        async for chunk in await engine.async_generate(PROMPTS[0], params, stream=True):
            text += chunk["text"]
        return one, many, text

    one, many, text = asyncio.run(main())
    assert one["output_ids"] == expected["output_ids"]
    assert all(m["output_ids"] == expected["output_ids"] for m in many)
    assert text == expected["text"]


def test_abort_frees_memory(engine):
    params = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    stream = engine.generate(PROMPTS[0], params, stream=True, rid="to-abort")
    chunks = []
    for i, chunk in enumerate(stream):
        chunks.append(chunk)
        if i == 3:
            engine.abort("to-abort")
    # the stream ended with the abort's chunk, soon after it (not by running its 2,000 tokens)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort", chunks[-1]["meta_info"]
    assert sum(len(c["output_ids"]) for c in chunks) < 200
    stats = engine.get_stats()
    assert engine_idle(stats)
    out = engine.generate(PROMPTS[1], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    # the engine serves on (gguf-q8 ends at EOS on some CPUs)
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_reports_the_reason(engine):
    import threading

    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            engine.generate(
                PROMPTS[2], {"max_new_tokens": 3000, "ignore_eos": True}, rid="abort-me"
            )
        )
    )
    t.start()
    # abort once a token is out (an unknown rid's abort is dropped)
    states = engine._resources.tokenizer_manager.requests.states
    deadline = time.monotonic() + 60
    while (
        not ((s := states.get("abort-me")) is not None and s.output_ids)
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    engine.abort("abort-me")
    t.join(30)
    assert result["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "aborted by the caller",
    }
    assert 0 < len(result["output_ids"]) < 3000
    assert engine_idle(engine.get_stats())


def test_cancelling_an_async_task_aborts_its_request(engine):
    async def main():
        task = asyncio.create_task(
            engine.async_generate(PROMPTS[3], {"max_new_tokens": 3000, "ignore_eos": True})
        )
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while not engine_idle(stats := engine.get_stats()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_idle(stats)


def test_abandoned_stream_aborts_its_request(engine):
    stream = engine.generate(PROMPTS[4], {"max_new_tokens": 3000, "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 10
    while not engine_idle(stats := engine.get_stats()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_idle(stats)


def test_custom_processor_bans_tokens(engine):
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    base = engine.generate(PROMPTS[7], params)["output_ids"]
    banned = sorted(set(base[:6]))
    out = engine.generate(
        PROMPTS[7],
        {
            **params,
            "custom_logit_processor": "disallowed_tokens",
            "custom_params": {"token_ids": banned},
        },
    )["output_ids"]
    assert not set(out) & set(banned)
    # sampled too, with a high temperature
    out = engine.generate(
        PROMPTS[7],
        {
            **params,
            "temperature": 1.5,
            "custom_logit_processor": "disallowed_tokens",
            "custom_params": {"token_ids": banned},
        },
    )["output_ids"]
    assert not set(out) & set(banned)


def test_force_token_after(engine):
    eos = engine.server_info["eos_token_ids"][0]
    out = engine.generate(
        PROMPTS[7],
        {
            "max_new_tokens": 30,
            "temperature": 0,
            "custom_logit_processor": "force_token_after",
            "custom_params": {"token_id": eos, "after": 5},
        },
    )
    assert len(out["output_ids"]) == 6 and out["output_ids"][-1] == eos
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_logit_bias_forces_a_token(engine, tokenizer):
    token = tokenizer.encode(" banana")[0]
    out = engine.generate(
        PROMPTS[0], {"max_new_tokens": 5, "temperature": 0.8, "logit_bias": {token: 100.0}}
    )
    assert out["output_ids"] == [token] * 5


def test_stream_closed_before_reading_aborts_its_request(engine):
    stream = engine.generate(PROMPTS[6], {"max_new_tokens": 3000, "ignore_eos": True}, stream=True)
    stream.close()  # never iterated
    deadline = time.monotonic() + 10
    while not engine_idle(stats := engine.get_stats()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_idle(stats)


def test_a_stream_in_a_with_block_is_aborted_when_the_block_ends(engine):
    """`break` never closes an iterator, so a stream held in a variable ran on to max_new_tokens after
    its loop; a `with` block (or `async with`) closes it however the block ends."""
    import asyncio

    with engine.generate(
        PROMPTS[6], {"max_new_tokens": 3000, "ignore_eos": True}, stream=True
    ) as stream:
        for _ in stream:
            break
    deadline = time.monotonic() + 10
    while not engine_idle(stats := engine.get_stats()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_idle(stats)

    async def read_one() -> None:
        async with await engine.async_generate(
            PROMPTS[6], {"max_new_tokens": 3000, "ignore_eos": True}, stream=True
        ) as s:
            async for _ in s:
                break

    asyncio.run(read_one())
    deadline = time.monotonic() + 10
    while not engine_idle(stats := engine.get_stats()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_idle(stats)


def test_stop_string_counts_as_a_finish_not_an_abort(engine):
    before = engine.get_stats()
    out = engine.generate(
        PROMPTS[7], {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [" "]}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " "}
    # the scheduler drops the request once the detokenizer's word of the match reaches it
    deadline = time.monotonic() + 30
    while (after := engine.get_stats())["finished_requests"] == before[
        "finished_requests"
    ] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after["finished_requests"] == before["finished_requests"] + 1
    assert after["aborted_requests"] == before["aborted_requests"]


def test_n_samples_of_a_chunked_prompt_share_its_prefill(engine):
    engine.flush_cache()
    # 2,048 here; the quantized engines' tests run it at 512
    chunk = engine.config.chunked_prefill_size
    ids = [(i * 7919) % 40000 + 100 for i in range(chunk + 452)]  # longer than one chunk
    before = engine.get_stats()
    outs = engine.generate(
        input_ids=ids, sampling_params={"n": 3, "max_new_tokens": 2, "temperature": 0.7, "seed": 3}
    )
    after = engine.get_stats()
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(ids) + 2
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, len(ids) - 1, len(ids) - 1]


def test_request_ids_colliding_after_n_expansion_are_refused(engine):
    """rid ["x", "x-0"] with n=2 on the first prompt made two requests "x-0": one state was kept, the
    scheduler ended the other as superseded, and generate waited forever (even across shutdown)."""
    import threading

    outcome: list = []

    def call() -> None:
        try:
            outcome.append(
                engine.generate(
                    ["The sky is", "Hello"],
                    [{"n": 2, "max_new_tokens": 3}, {"max_new_tokens": 3}],
                    rid=["x", "x-0"],
                )
            )
        except Exception as exc:  # noqa: BLE001 - the test's point
            outcome.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "generate hung on two requests with the same id"
    assert isinstance(outcome[0], ValueError) and "x-0" in str(outcome[0]), outcome
    # an expanded id that a running request holds is refused too
    tm = engine._resources.tokenizer_manager
    states, _ = tm.submit("Hi", {"max_new_tokens": 40, "ignore_eos": True}, rid="y-1")
    try:
        with pytest.raises(ValueError, match="y-1"):
            engine.generate("Hi", {"n": 2, "max_new_tokens": 2}, rid="y")
    finally:
        tm.abort(["y-1"])
        assert states[0].done.wait(30)
    assert engine.get_stats()["tracked"]["user"]["states"] == 0


def test_a_streams_late_abort_never_reaches_a_request_reusing_its_rid(engine, monkeypatch):
    """A stream closed after its request finished (its last chunk unread) queues an abort that the
    receiver thread sends later; it took the rid's submission number at send time, so it aborted a new
    request given the same rid meanwhile. (Here the receiver is woken only once the new one is in.)"""
    tm = engine._resources.tokenizer_manager
    stream = engine.generate(
        PROMPTS[0],
        {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
        rid="reused",
        stream=True,
    )
    deadline = time.monotonic() + 60
    while "reused" in tm.requests.states and time.monotonic() < deadline:  # finished, chunks unread
        time.sleep(0.01)
    with monkeypatch.context() as m:
        m.setattr(tm.aborts, "_wake", lambda: None)  # the abort stays queued
        stream.close()
        assert len(tm.aborts._deferred) == 1
        out: dict = {}
        t = threading.Thread(
            target=lambda: out.update(
                engine.generate(
                    PROMPTS[1],
                    {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
                    rid="reused",
                )
            )
        )
        t.start()
        while "reused" not in tm.requests.states and t.is_alive():
            time.sleep(0.005)
    tm.receiver.wake()  # the queued abort goes now, while the new request runs
    t.join(60)
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]["finish_reason"]
    assert len(out["output_ids"]) == 24


def test_a_name_standing_for_n_copies_is_taken_while_they_run(engine):
    """The rid of an n > 1 call names its copies for abort(); it was not reserved: another call could take
    it (abort then hit both calls), and a copy's rid reused meanwhile kept the group, and abort(name) with
    it, alive after the copies ended."""
    tm = engine._resources.tokenizer_manager
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    grp = engine.generate(PROMPTS[0], {**long, "n": 2}, rid="grp", stream=True)
    solo = engine.generate(PROMPTS[1], long, rid="solo", stream=True)
    try:
        with pytest.raises(ValueError, match=r"already running: \['grp'\]"):
            engine.generate(PROMPTS[2], long, rid="grp")
        with pytest.raises(ValueError, match=r"already running: \['solo'\]"):
            engine.generate(PROMPTS[2], {**long, "n": 2}, rid="solo")

        def ended(rid: str) -> None:
            deadline = time.monotonic() + 60
            while rid in tm.requests.states and time.monotonic() < deadline:
                time.sleep(0.01)
            assert rid not in tm.requests.states

        engine.abort("grp-0")
        ended("grp-0")
        reuse = engine.generate(
            PROMPTS[3],
            {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
            rid="grp-0",
            stream=True,
        )
        engine.abort("grp-1")
        ended("grp-1")
        # its copies ended: the name is free, whoever runs as grp-0 now
        assert "grp" not in tm.requests.groups
        engine.abort("grp")  # names nothing running
        last = [c for c in reuse][-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length", last["meta_info"]
    finally:
        grp.close()
        solo.close()
    deadline = time.monotonic() + 30
    while not engine_idle(stats := engine.get_stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["tracked"]["user"]["groups"] == 0 and engine_idle(stats)


def test_ctrl_c_in_generate_aborts_its_requests(engine):
    """Ctrl-C while generate() waits (a notebook cell interrupted): its requests ran on to max_new_tokens,
    holding memory, their rids refused to the cell run again."""
    import signal
    import sys

    tm = engine._resources.tokenizer_manager
    seen: dict = {}

    def waiting() -> bool:  # the main thread is in TokenizerManager.wait
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None:
            if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith(
                "tokenizer_manager.py"
            ):
                return True
            frame = frame.f_back
        return False

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while (
            not ("interrupted" in tm.requests.states and waiting()) and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        seen["state"] = tm.requests.states.get("interrupted")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        engine.generate(
            PROMPTS[0],
            {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True},
            rid="interrupted",
        )
    state = seen["state"]
    assert state is not None and state.done.wait(120)
    assert state.finish_reason.type == "abort", state.finish_reason
    # the rid is free
    again = engine.generate(
        PROMPTS[0], {"max_new_tokens": 2, "ignore_eos": True}, rid="interrupted"
    )
    assert again["meta_info"]["completion_tokens"] == 2


def test_a_batchs_bad_entry_is_named_the_first_one_too(engine):
    with pytest.raises(ValueError, match=r"^request 0: the prompt is empty"):
        engine.generate(input_ids=[[], [1]], sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match=r"^sampling_params\[1\]: .*temprature"):
        engine.generate(["a", "b"], [{"max_new_tokens": 1}, {"temprature": 0}])
    with pytest.raises(ValueError, match=r"^the prompt is empty"):  # one prompt: no index
        engine.generate(input_ids=[], sampling_params={"max_new_tokens": 1})


def test_a_chat_turn_without_content_is_rendered_as_transformers_does(tokenizer):
    """An assistant turn holding only tool_calls has no content key (OpenAI's shape); transformers'
    apply_chat_template renders it where the template allows, the engine refused it: each message
    needed 'content'. (SmolLM2's template needs content: both then refuse it.)"""
    import copy

    from engine.frontend.tokenize_stage import render_chat

    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "tool_calls": []},
        {"role": "user", "content": "Answer in one word."},
    ]
    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m.get('content') or '(tools)' }}\n{% endfor %}"
    )
    ids = render_chat(tok, messages)
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ids == tok.encode(want, add_special_tokens=False) and "assistant: (tools)" in want
    with pytest.raises(ValueError, match="needs 'role'"):
        render_chat(tok, [{"content": "no role"}])


def test_a_stream_closed_from_another_thread_while_read_is_aborted(engine):
    """A watchdog closing a stream its consumer is blocked reading: the generator's close raised
    `generator already executing` (aclose: `already running`) before the abort was sent, and the
    request ran to its end. The abort goes first now; the consumer's loop ends with it."""
    params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    stream = engine.generate(PROMPTS[0], params, stream=True)
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(stream))
    reader.start()
    while not got:
        time.sleep(0.01)
    stream.close()
    reader.join(60)
    assert not reader.is_alive() and got[-1]["meta_info"]["finish_reason"]["type"] == "abort", got[
        -1
    ]["meta_info"]
    assert sum(len(c["output_ids"]) for c in got) < 400

    async def closed_by_another_task() -> list:
        stream = await engine.async_generate(PROMPTS[0], params, stream=True)
        chunks: list = []

        async def read() -> None:
            async for chunk in stream:
                chunks.append(chunk)

        task = asyncio.create_task(read())
        while not chunks:
            await asyncio.sleep(0.01)
        await stream.aclose()
        await asyncio.wait_for(task, 60)
        return chunks

    chunks = asyncio.run(closed_by_another_task())
    assert (
        chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        and sum(len(c["output_ids"]) for c in chunks) < 400
    )


class _Interrupted(BaseException):
    """Stands for Ctrl-C reaching the caller (a KeyboardInterrupt would stop pytest itself)."""


def test_a_call_interrupted_before_its_requests_are_sent_leaves_nothing_registered(
    engine, monkeypatch
):
    """Ctrl-C while the call waited for the socket (another thread encoding a big batch holds it): its
    requests stayed registered, never sent, for the engine's lifetime, and their rid could never be
    used again ('already running')."""
    tm = engine._resources.tokenizer_manager

    class Refusing:
        def __enter__(self):
            raise _Interrupted()

        def __exit__(self, *exc):
            return False

    real = tm.channel.lock
    monkeypatch.setattr(tm.channel, "lock", Refusing())
    with pytest.raises(_Interrupted):
        engine.generate("Hi", {"max_new_tokens": 2}, rid="interrupted")
    monkeypatch.setattr(tm.channel, "lock", real)
    assert "interrupted" not in tm.requests.states
    assert (
        engine.generate("Hi", {"max_new_tokens": 2}, rid="interrupted")["meta_info"][
            "completion_tokens"
        ]
        == 2
    )


def test_an_abort_racing_its_requests_submission_still_stops_it(engine, monkeypatch):
    """Once registered, a request can be aborted; if the abort reached the socket before the request
    itself (registered outside the send lock: a thread preempted between the two), the scheduler
    matched nothing, and the request then ran to its end. Registering and sending are one step now."""
    tm = engine._resources.tokenizer_manager
    real = tm.requests.register

    def slow_register(states):
        real(states)
        time.sleep(0.3)  # the submitting thread preempted right after registering

    monkeypatch.setattr(tm.requests, "register", slow_register)
    results: list = []
    submitter = threading.Thread(
        target=lambda: results.append(
            engine.generate(
                PROMPTS[1],
                {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True},
                rid="racing",
            )
        )
    )
    submitter.start()
    deadline = time.monotonic() + 30
    while "racing" not in tm.requests.states and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.abort("racing")
    submitter.join(60)
    assert results and results[0]["meta_info"]["finish_reason"]["type"] == "abort", results


def test_a_call_making_more_sequences_than_the_bound_is_refused_before_anything_is_built(
    engine, monkeypatch
):
    """1,000 prompts with n=128 (a 5 KB body over HTTP) queued 128,000 requests, grew the user process by
    320 MB and held the engine for 40 minutes. A call's sequences (prompts x n; a beam search's beams)
    are bounded by max_sequences_per_call (4,096 by default), checked before a prompt is tokenized."""
    tm = engine._resources.tokenizer_manager
    before = engine.get_stats()

    def tokenize(*args, **kwargs):
        raise AssertionError("the call was tokenized before its size was checked")

    monkeypatch.setattr(tm.submission, "_tokenize", tokenize)
    one = {"max_new_tokens": 1}
    with pytest.raises(
        ValueError,
        match=r"n=128 for each of 33 prompts makes 4,224 sequences.*max_sequences_per_call",
    ):
        engine.generate(input_ids=[[5]] * 33, sampling_params={**one, "n": 128})
    with pytest.raises(ValueError, match=r"^prompt: 4,097 prompts make 4,097 sequences"):
        engine.generate(["a"] * 4097, one)
    with pytest.raises(ValueError, match=r"^sampling_params: .* 4,100 sequences"):
        engine.generate(input_ids=[[5]] * 41, sampling_params=[{**one, "n": 100}] * 41)
    with pytest.raises(ValueError, match=r"^messages: 4,097 prompts"):
        asyncio.run(
            engine.async_generate(
                messages=[[{"role": "user", "content": "a"}]] * 4097, sampling_params=one
            )
        )
    with pytest.raises(
        ValueError, match=r"^beam_width=8 for each of 513 prompts makes 4,104 sequences"
    ):
        engine.beam_search(["a"] * 513, beam_width=8, max_new_tokens=1)
    after = engine.get_stats()
    assert (
        after["prompt_tokens"] == before["prompt_tokens"]
        and after["tracked"]["user"]["states"] == 0
    )
    assert engine.server_info["max_sequences_per_call"] == 4096


def test_the_sequence_count_of_each_input_shape():
    """prompts x n, each entry's own n in a list of sampling_params, beam_width per prompt; values the
    later checks refuse by name (n out of range, a malformed input) count as one."""
    from engine.ipc.messages import BeamParams
    from engine.frontend.request_checks import check_call_size

    def fits(limit: int, **call) -> bool:
        call.setdefault("sampling_params", None)
        try:
            check_call_size(
                limit,
                call.pop("prompt", None),
                call.pop("input_ids", None),
                call.pop("messages", None),
                call.pop("sampling_params"),
                call.pop("beam", None),
            )
        except ValueError:
            return False
        return True

    chat = [{"role": "user", "content": "a"}]
    assert fits(8, prompt=["a"] * 2, sampling_params={"n": 4}) and not fits(
        8, prompt=["a"] * 3, sampling_params={"n": 3}
    )
    assert fits(8, prompt="a", sampling_params={"n": 8}) and not fits(
        7, prompt="a", sampling_params={"n": 8}
    )
    assert (
        fits(8, input_ids=[[1]] * 8)
        and not fits(8, input_ids=[[1]] * 9)
        and fits(2, input_ids=[1, 2, 3])
    )
    assert (
        fits(2, messages=chat) and fits(2, messages=[chat] * 2) and not fits(2, messages=[chat] * 3)
    )
    assert fits(9, input_ids=[[1], [2]], sampling_params=[{"n": 5}, {"n": 4}])
    assert not fits(8, input_ids=[[1], [2]], sampling_params=[{"n": 5}, {"n": 4}])
    assert fits(9, prompt=["a"] * 3, beam=BeamParams(3)) and not fits(
        8, prompt=["a"] * 3, beam=BeamParams(3)
    )
    for n in (10**12, "x", True, None):
        assert fits(2, prompt=["a"] * 2, sampling_params={"n": n})


def test_max_sequences_per_call_is_checked_at_start():
    from engine import Engine

    for value in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_sequences_per_call must be"):
            Engine(max_sequences_per_call=value)

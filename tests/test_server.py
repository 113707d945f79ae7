"""`engine serve` as a real subprocess on 127.0.0.1, driven by the real `openai` client and plain
HTTP: outputs equal Engine.generate's, OpenAI's shapes and error bodies, the API key, a client
going away, Prometheus metrics, and the Grafana dashboard's queries."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import engine_idle
from server_helpers import HOLD, HOLD_OUTPUT, PLUGIN, TESTS_DIR, UNSENT, start_server, stop_server

KEY = "test-key-123"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"max_new_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    srv = start_server(
        "--max-total-tokens",
        "16384",
        "--api-key",
        KEY,
        "--max-request-bytes",
        "65536",
        "--served-model-name",
        "smol",
        "--plugins",
        PLUGIN,
        env={"PYTHONPATH": TESTS_DIR},
    )
    yield srv
    assert stop_server(srv) == 0, srv.output()
    assert KEY not in srv.output()  # the API key is never logged


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(server, method: str, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    kwargs.setdefault("timeout", 120)
    return httpx.request(method, server.url + path, headers=headers, **kwargs)


def test_models_health_and_server_info(server, client):
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert http(server, "GET", "/health", key=None).status_code == 200  # probes need no key
    info = http(server, "GET", "/server_info").json()
    assert info["served_model_name"] == "smol" and set(info["pids"]) == {
        "user",
        "scheduler",
        "detokenizer",
    }


def test_the_ready_line_names_the_port_bound_for_port_0(server):
    """start_server passes --port 0: the ready line must name the port the system chose."""
    from engine.serve.cli import url_of

    assert f"ready on http://127.0.0.1:{server.port} " in server.output() and server.port > 0
    assert http(server, "GET", "/health", key=None).status_code == 200
    assert (
        url_of(("::1", 8000, 0, 0)) == "http://[::1]:8000"
        and url_of(("0.0.0.0", 80)) == "http://0.0.0.0:80"
    )


def test_greedy_chat_and_completions_equal_engine_generate(client, engine):
    chat = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=16, temperature=0)
    ref = engine.generate(messages=CHAT, sampling_params=GREEDY)
    assert (
        chat.choices[0].message.content == ref["text"]
        and chat.choices[0].message.role == "assistant"
    )
    assert chat.choices[0].finish_reason == (
        "length" if ref["meta_info"]["finish_reason"]["type"] == "length" else "stop"
    )
    assert chat.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert chat.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    prompts = ["The sky is", "def fibonacci(n):"]
    refs = engine.generate(prompts, GREEDY)
    one = client.completions.create(model="smol", prompt=prompts[0], max_tokens=16, temperature=0)
    assert one.choices[0].text == refs[0]["text"]
    both = client.completions.create(model="smol", prompt=prompts, max_tokens=16, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [
        r["text"] for r in refs
    ]
    assert both.usage.prompt_tokens == sum(r["meta_info"]["prompt_tokens"] for r in refs)
    ids = engine.tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == engine.generate(input_ids=ids, sampling_params=GREEDY)["text"]


def test_streams_equal_the_non_streamed_answer(client):
    kwargs = dict(model="smol", messages=CHAT, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason in ("stop", "length")
    # include_usage: the last chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    done = (
        client.completions.create(model="smol", prompt="The sky is", max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    streamed = client.completions.create(
        model="smol", prompt="The sky is", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == done


def test_async_client_concurrent_and_streaming(server):
    from openai import AsyncOpenAI

    async def main():
        aclient = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        prompts = ["One, two,", "Red, green,", "Monday, Tuesday,"]
        outs = await asyncio.gather(
            *(
                aclient.completions.create(model="smol", prompt=p, max_tokens=8, temperature=0)
                for p in prompts
            )
        )
        stream = await aclient.chat.completions.create(
            model="smol", messages=CHAT, max_tokens=10, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        plain = await aclient.chat.completions.create(
            model="smol", messages=CHAT, max_tokens=10, temperature=0
        )
        await aclient.close()
        return outs, text, plain.choices[0].message.content

    outs, text, plain = asyncio.run(main())
    assert all(o.choices[0].text for o in outs)
    assert text == plain


def test_n_seed_stop_and_engine_extras(client, engine):
    kwargs = dict(model="smol", messages=CHAT, max_tokens=12, temperature=0.9, seed=7, n=3)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    # seeded
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    refs = engine.generate(
        messages=CHAT, sampling_params={"max_new_tokens": 12, "temperature": 0.9, "seed": 7, "n": 3}
    )
    assert [c.message.content for c in first.choices] == [r["text"] for r in refs]
    # counted once, as OpenAI does
    assert first.usage.prompt_tokens == refs[0]["meta_info"]["prompt_tokens"]

    stopped = client.completions.create(
        model="smol", prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=40, temperature=0, stop=[" 9"]
    )
    assert stopped.choices[0].finish_reason == "stop" and " 9" not in stopped.choices[0].text
    assert (
        stopped.choices[0].text
        == engine.generate(
            "Count: 1, 2, 3, 4, 5, 6,", {"max_new_tokens": 40, "temperature": 0, "stop": [" 9"]}
        )["text"]
    )
    long = client.completions.create(
        model="smol",
        prompt="Hi",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "top_k": 1, "min_tokens": 20},
    )
    assert long.usage.completion_tokens == 20 and long.choices[0].finish_reason == "length"


def test_logprobs_equal_the_engines(client, engine):
    chat = client.chat.completions.create(
        model="smol", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    ref = engine.generate(
        messages=CHAT,
        sampling_params={"max_new_tokens": 6, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=2,
    )
    content = chat.choices[0].logprobs.content
    expected = ref["meta_info"]["output_token_logprobs"]
    assert len(content) == len(expected)
    for item, (lp, tid, _) in zip(content, expected):
        assert item.logprob == pytest.approx(lp, abs=1e-4)
        assert item.token == engine.tokenizer.decode([tid])
        assert (
            len(item.top_logprobs) == 2
            and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        )
    comp = client.completions.create(
        model="smol", prompt="The sky is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0
    streamed = client.completions.create(
        model="smol", prompt="The sky is", max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.token_logprobs] == pytest.approx(
        lp.token_logprobs, abs=1e-5
    )
    held = client.completions.create(
        model="smol",
        prompt="Once upon a time",
        max_tokens=24,
        temperature=0,
        logprobs=1,
        stream=True,
        stop=[" the end of it all"],
        stream_options={"include_usage": True},
    )
    # text that may start the stop string is held back: its tokens' logprobs still come
    held = list(held)
    assert (
        sum(len(c.choices[0].logprobs.tokens) for c in held if c.choices)
        == held[-1].usage.completion_tokens
    )
    # every chunk has its own tokens' alternatives
    tops = [t for p in pieces for t in p.top_logprobs]
    assert [sorted(t) for t in tops] == [sorted(t) for t in lp.top_logprobs]
    for got, want in zip(tops, lp.top_logprobs):
        assert [got[k] for k in sorted(got)] == pytest.approx(
            [want[k] for k in sorted(want)], abs=1e-4
        )


def test_completions_top_logprobs_hold_the_chosen_token_too(client, engine):
    """OpenAI's legacy completions: "the API will always return the logprob of the sampled token, so
    there may be up to logprobs+1 elements". A token chosen outside the top (here forced by logit_bias;
    logprobs are the model's own) was missing from its position's top_logprobs."""
    london = engine.tokenizer.encode(" London", add_special_tokens=False)
    assert len(london) == 1
    out = client.completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=1,
        temperature=0,
        logprobs=1,
        logit_bias={str(london[0]): 100},
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == [" London"] and len(lp.top_logprobs[0]) == 2
    assert lp.top_logprobs[0][" London"] == pytest.approx(lp.token_logprobs[0])
    # the model's own top is there too
    assert max(lp.top_logprobs[0].values()) > lp.token_logprobs[0]


JAPANESE = [
    {"role": "user", "content": "Write the Japanese word for thank you, in Japanese script only."}
]


def _as_openai_writes(raw: bytes) -> str:
    try:
        return raw.decode()
    # part of a character: "bytes:" and escapes, as OpenAI's tokens show it
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_logprob_bytes_are_each_tokens_own_utf8_bytes(client, engine):
    """Byte-level BPE tokens may hold part of a character (Japanese text is mostly such tokens): their
    bytes are the token's own, so all of them together are the text's UTF-8; the token is its text, or
    "bytes:\\xe3\\x81" for part of a character; completions' text_offset counts the characters completed."""
    out = client.chat.completions.create(
        model="smol", messages=JAPANESE, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content, text = out.choices[0].logprobs.content, out.choices[0].message.content
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", "replace") == text and any(ord(ch) > 0x3000 for ch in text), text
    partial = [c for c in content if c.token.startswith("bytes:")]
    assert partial, [c.token for c in content]  # the case this test is for
    for c in content:
        assert c.token == _as_openai_writes(bytes(c.bytes))
        # greedy: the best is the one taken
        assert (c.top_logprobs[0].token, c.top_logprobs[0].bytes) == (
            c.token,
            c.bytes,
        )
    chat = engine.tokenizer.apply_chat_template(
        JAPANESE, add_generation_prompt=True, tokenize=False
    )
    # the chat's prompt, as the engine makes it
    ids = engine.tokenizer.encode(chat, add_special_tokens=False)
    comp = client.completions.create(
        model="smol", prompt=ids, max_tokens=8, temperature=0, logprobs=1
    )
    lp = comp.choices[0].logprobs
    assert comp.choices[0].text == text and lp.tokens == [c.token for c in content]
    done, offsets = b"", []
    for c in content:
        offsets.append(len(done.decode("utf-8", "ignore")))  # characters wholly before the token
        done += bytes(c.bytes)
    assert lp.text_offset == offsets
    streamed = client.completions.create(
        model="smol", prompt=ids, max_tokens=8, temperature=0, logprobs=1, stream=True
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens and [
        o for p in pieces for o in p.text_offset
    ] == offsets


BAD = [
    # (method, path, body or raw bytes, headers override (None: the key), status, words the message must hold, param)
    ("POST", "/v1/chat/completions", {"model": "smol"}, None, 400, "messages", "messages"),
    ("POST", "/v1/chat/completions", {"messages": []}, None, 400, "messages", "messages"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": "hot"},
        None,
        400,
        "temperature",
        "temperature",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": -1},
        None,
        400,
        "temperature",
        "temperature",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": "0"},
        None,
        400,
        "temperature",
        "temperature",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": True},
        None,
        400,
        "temperature",
        "temperature",
    ),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": "1"}, None, 400, "top_p", "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "min_p": False}, None, 400, "min_p", "min_p"),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"5": "1"}},
        None,
        400,
        "logit_bias",
        "logit_bias",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 0},
        None,
        400,
        "max_tokens",
        "max_tokens",
    ),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "n": 0}, None, 400, "n must", "n"),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "n": 100000}, None, 400, "n must", "n"),
    # refused at once, not expanded
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "n": 10**12},
        None,
        400,
        "n must",
        "n",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        None,
        400,
        "stream: true",
        None,
    ),
    ("POST", "/v1/completions", b"", None, 400, "body is missing", None),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 10**9},
        None,
        400,
        "context",
        "max_tokens",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "tools": []},
        None,
        400,
        "unsupported parameter: tools",
        "tools",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "top_logprobs": 2},
        None,
        400,
        "requires logprobs",
        "top_logprobs",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 99},
        None,
        400,
        "top_logprobs",
        "top_logprobs",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        None,
        400,
        "role",
        "messages.0.role",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "model": "gpt-4"},
        None,
        404,
        "gpt-4",
        "model",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"abc": 1}},
        None,
        400,
        "logit_bias",
        "logit_bias",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"99999999": 1}},
        None,
        400,
        "logit_bias",
        "logit_bias",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {"+5": 1}},
        None,
        400,
        "logit_bias",
        "logit_bias",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "logit_bias": {" 10 ": 1}},
        None,
        400,
        "logit_bias",
        "logit_bias",
    ),
    (
        "POST",
        "/v1/completions",
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {  # a 500 before
                    "name": "deep",
                    "schema": json.loads('{"not": ' * 200 + "{}" + "}" * 200),
                },
            },
        },
        None,
        400,
        "nested",
        None,
    ),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["a"] * 40}, None, 400, "stop", "stop"),
    # a beam search's selection failed its whole step on these (200 with empty text, and other requests aborted)
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "stop_token_ids": [0] * 2000},
        None,
        400,
        "stop_token_ids",
        "stop_token_ids",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "use_beam_search": True, "stop_token_ids": list(range(1025))},
        None,
        400,
        "stop_token_ids",
        "stop_token_ids",
    ),
    # a 5 KB body queued 128,000 requests
    (
        "POST",
        "/v1/completions",
        {"prompt": ["a"] * 1000, "n": 5, "max_tokens": 1},
        None,
        400,
        "max_sequences_per_call",
        "n",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": [[5]] * 600, "use_beam_search": True, "beam_width": 8, "max_tokens": 1},
        None,
        400,
        "max_sequences_per_call",
        None,
    ),
    ("POST", "/v1/completions", {"prompt": []}, None, 400, "", None),
    # the engine's input_ids is the prompt here
    (
        "POST",
        "/v1/completions",
        {"prompt": [-5, 3]},
        None,
        400,
        "",
        "prompt",
    ),
    ("POST", "/v1/completions", {"prompt": [[1], [99999999]]}, None, 400, "", "prompt"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        None,
        400,
        "content",
        "messages.0.content",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        None,
        400,
        "text",
        "messages.0.content.0.text",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "response_format": {"type": "json_object"}, "regex": "a"},
        None,
        400,
        "at most one",
        "regex",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 0},
        None,
        400,
        "max_completion_tokens",
        "max_completion_tokens",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "min_tokens": 9, "max_completion_tokens": 5},
        None,
        400,
        "max_completion_tokens=5",
        "min_tokens",
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "min_tokens": 9, "max_tokens": 5},
        None,
        400,
        "max_tokens=5",
        "min_tokens",
    ),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "seed": 2**63}, None, 400, "seed", "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 2}, None, 400, "best_of", "best_of"),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "x"}, None, 400, "suffix", "suffix"),
    # documented: (0, 1]
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "top_p": 0},
        None,
        400,
        "top_p",
        "top_p",
    ),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x", "custom_logit_processor": "nope"},
        None,
        400,
        "nope",
        "custom_logit_processor",
    ),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True}, None, 400, "echo", "echo"),
    ("POST", "/v1/completions", b"{not json", None, 400, "not valid JSON", None),
    ("POST", "/v1/completions", b"[1, 2]", None, 400, "", None),
    ("POST", "/v1/completions", {"prompt": "x" * 70000}, None, 413, "max-request-bytes", None),
    ("POST", "/v1/completions", {"prompt": "x"}, {}, 401, "missing API key", None),
    (
        "POST",
        "/v1/completions",
        {"prompt": "x"},
        {"Authorization": "Bearer wrong"},
        401,
        "invalid API key",
        None,
    ),
    ("GET", "/v1/completions", None, None, 405, "method GET", None),
    ("GET", "/v1/nothing-here", None, None, 404, "/v1/nothing-here", None),
    ("POST", "/generate", {"text": "x", "input_ids": [1]}, None, 400, "exactly one", "text"),
    (
        "POST",
        "/generate",
        {"text": "x", "sampling_params": {"temperature": -3}},
        None,
        400,
        "temperature",
        None,
    ),
]


@pytest.mark.parametrize(
    "method,path,body,headers,status,words,param",
    BAD,
    ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)],
)
def test_bad_requests_get_openai_error_bodies(
    server, method, path, body, headers, status, words, param
):
    all_headers = {"Authorization": f"Bearer {KEY}"} if headers is None else dict(headers)
    if isinstance(body, bytes):
        all_headers["Content-Type"] = "application/json"
        r = httpx.request(method, server.url + path, content=body, headers=all_headers, timeout=60)
    else:
        r = httpx.request(method, server.url + path, json=body, headers=all_headers, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    # the engine's own names never leak
    assert "Traceback" not in r.text and "_new_tokens" not in r.text
    if param is not None:
        assert error["param"] == param, error


def test_405_says_allow_and_the_auth_scheme_is_case_insensitive(server):
    r = http(server, "GET", "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    for scheme in ("bearer", "BEARER"):  # RFC 9110: auth schemes are case-insensitive
        assert (
            http(
                server, "GET", "/v1/models", key=None, headers={"Authorization": f"{scheme} {KEY}"}
            ).status_code
            == 200
        )
    assert (
        http(
            server, "GET", "/v1/models", key=None, headers={"Authorization": f"Basic {KEY}"}
        ).status_code
        == 401
    )


NULLABLE = {
    "model": None,
    "max_tokens": None,
    "temperature": None,
    "top_p": None,
    "n": None,
    "stop": None,
    "seed": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "logit_bias": None,
    "user": None,
    "stream": None,
    "stream_options": None,
    "response_format": None,
    "top_k": None,
    "min_p": None,
    "repetition_penalty": None,
    "min_tokens": None,
    "ignore_eos": None,
    "stop_token_ids": None,
    "skip_special_tokens": None,
    "spaces_between_special_tokens": None,
    "custom_logit_processor": None,
    "custom_params": None,
    "regex": None,
    "ebnf": None,
    "use_beam_search": None,
    "beam_width": None,
    "length_penalty": None,
    "early_stopping": None,
    "include_stop_str_in_output": None,
    "no_stop_trim": None,
    "json_schema": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "priority": None,
}


def test_null_means_the_default_in_every_nullable_field(server):
    """OpenAI types these fields "X or null"; clients (and the openai client's model_dump) send null."""
    chat = {
        **NULLABLE,
        "messages": [{"role": "user", "content": "Hi", "name": None}],
        "max_completion_tokens": 3,
        "logprobs": None,
        "top_logprobs": None,
        "temperature": 0,
    }
    r = http(server, "POST", "/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    # n and logprobs: defaults
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    comp = {
        **NULLABLE,
        "prompt": "The sky is",
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": None,
        "echo": None,
        "suffix": None,
        "best_of": None,
    }
    r = http(server, "POST", "/v1/completions", json=comp)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
    streamed = {**comp, "stream": True, "stream_options": {"include_usage": None}}
    r = http(server, "POST", "/v1/completions", json=streamed)
    assert (
        r.status_code == 200
        and '"usage"' not in r.text
        and r.text.rstrip().endswith("data: [DONE]")
    ), r.text
    schema = {
        **comp,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "o", "description": None, "strict": None, "schema": None},
        },
    }
    # a schema of null is no schema: still a 400
    r = http(server, "POST", "/v1/completions", json=schema)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_values_openai_accepts_are_accepted(client):
    """Any int64 seed (mapped onto the engine's [0, 2**63) the same way each time), best_of equal
    to n and an empty suffix (both no-ops)."""
    kwargs = dict(model="smol", messages=CHAT, max_tokens=3, temperature=1.0, seed=-1, n=2)
    first, again = (
        client.chat.completions.create(**kwargs),
        client.chat.completions.create(**kwargs),
    )
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    out = client.completions.create(
        model="smol", prompt="Hi", max_tokens=2, temperature=0, best_of=1, suffix=""
    )
    assert out.usage.completion_tokens <= 2
    chunks = client.completions.create(
        model="smol",
        prompt="Hi",
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [2]


def test_completions_without_max_tokens_stop_at_openais_16(client):
    """OpenAI's legacy completions (and vLLM's, SGLang's) default max_tokens to 16; chat to what the
    context leaves. Completions ran to the whole context."""
    out = client.completions.create(
        model="smol", prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_a_history_replayed_from_openai_responses_is_accepted(server, client, engine):
    """An assistant message as the openai client models it (message.model_dump(): refusal, tool_calls,
    function_call, audio, annotations, all null) or holding a refusal: the fields that say nothing are
    ignored, a refusal is the assistant's text, tool calls are refused by name."""
    from openai.types.chat import ChatCompletionMessage

    said = ChatCompletionMessage(role="assistant", content="Paris.").model_dump()
    said["annotations"] = []
    history = [CHAT[0], said, {"role": "user", "content": "And Germany?"}]
    out = client.chat.completions.create(
        model="smol", messages=history, max_tokens=3, temperature=0
    )
    plain = [CHAT[0], {"role": "assistant", "content": "Paris."}, history[2]]
    assert (
        out.choices[0].message.content
        == engine.generate(messages=plain, sampling_params={"max_new_tokens": 3, "temperature": 0})[
            "text"
        ]
    )
    refused = "I can't help with that."
    as_text = [CHAT[0], {"role": "assistant", "content": refused}, history[2]]
    want = engine.generate(messages=as_text, sampling_params={"max_new_tokens": 1})["meta_info"][
        "prompt_tokens"
    ]
    for message in (
        {"role": "assistant", "content": None, "refusal": refused},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": refused}]},
    ):
        r = http(
            server,
            "POST",
            "/v1/chat/completions",
            json={"messages": [CHAT[0], message, history[2]], "max_tokens": 1},
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == want, r.text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for message, param in (
        ({**said, "tool_calls": [call]}, "messages.1.tool_calls"),
        ({**said, "function_call": call["function"]}, "messages.1.function_call"),
        ({**said, "audio": {"id": "a1"}}, "messages.1.audio"),
    ):
        r = http(
            server,
            "POST",
            "/v1/chat/completions",
            json={"messages": [CHAT[0], message], "max_tokens": 1},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "not supported" in r.json()["error"]["message"], r.text
    # only an assistant refuses
    user_refusal = {
        "role": "user",
        "content": [{"type": "refusal", "refusal": "no"}],
    }
    r = http(
        server, "POST", "/v1/chat/completions", json={"messages": [user_refusal], "max_tokens": 1}
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content"), (
        r.text
    )


def test_server_serves_on_after_bad_requests(client):
    out = client.completions.create(
        model="smol", prompt="Still there?", max_tokens=3, temperature=0
    )
    assert out.usage.completion_tokens == 3


def _stats(server) -> dict:
    return http(server, "GET", "/stats").json()


def _wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    stats = _stats(server)
    while not engine_idle(stats) and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = _stats(server)
    return stats


def test_a_client_leaving_mid_stream_frees_its_kv(server):
    before = _wait_idle(server)
    body = {
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 2000,
        "stream": True,
        "extra": None,
    }
    body.pop("extra")
    body["ignore_eos"] = True
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events >= 3:
                break  # leave: the connection closes
    stats = _wait_idle(server)
    assert engine_idle(stats), stats
    assert stats["aborted_requests"] == before["aborted_requests"] + 1
    # it did not run on to 2,000
    assert stats["generated_tokens"] - before["generated_tokens"] < 1000


def test_a_client_leaving_a_plain_request_frees_its_kv(server):
    before = _wait_idle(server)
    body = {"prompt": "Tell me everything.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            json=body,
            timeout=1.5,
            headers={"Authorization": f"Bearer {KEY}"},
        )
    stats = _wait_idle(server)
    assert engine_idle(stats), stats
    assert stats["aborted_requests"] == before["aborted_requests"] + 1


def _held(
    server, path, body: dict, timeout: float = 120, route: str = "/v1/completions"
) -> tuple[threading.Thread, dict]:
    """Send body (to a completion: with a prompt whose tokenizing the test plugin holds until path.release;
    to another route, marked by the caller as the plugin reads it); return once it is held (the thread that
    sent it, and where its outcome lands)."""
    outcome: dict = {}
    if route == "/v1/completions":
        body = {**body, "prompt": f"{HOLD}{path}\n{body['prompt']}"}

    def send() -> None:
        try:
            outcome["response"] = http(server, "POST", route, timeout=timeout, json=body)
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 60
    try:
        while not path.with_suffix(".entered").exists():
            assert time.monotonic() < deadline and sender.is_alive(), outcome
            time.sleep(0.01)
    except BaseException:
        path.with_suffix(".release").touch()  # never leave the shared submit worker held
        raise
    return sender, outcome


def test_tokenizing_runs_off_the_event_loop(server, tmp_path):
    """While a prompt is being tokenized (held there by the test plugin, as a megabyte prompt holds
    it for seconds) the server goes on answering, other requests included: they are not queued
    behind it; the held request then completes as usual."""
    hold = tmp_path / "hold"
    sender, outcome = _held(server, hold, {"prompt": "Hello", "max_tokens": 1})
    try:
        assert http(server, "GET", "/health", key=None, timeout=30).status_code == 200
        assert http(server, "GET", "/v1/models", timeout=30).status_code == 200
        other = http(
            server,
            "POST",
            "/v1/completions",
            timeout=30,
            json={"model": "smol", "prompt": "Hi", "max_tokens": 2},
        )
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] >= 1, (
            other.text
        )
        assert sender.is_alive() and not outcome  # answered while the tokenizing still waited
    finally:
        hold.with_suffix(".release").touch()
        sender.join(60)
    assert outcome["response"].status_code == 200, outcome


def test_a_finished_answer_is_built_off_the_event_loop(server, tmp_path):
    """Between the engine's last output and the response (the output hook, the result's lists of logprobs,
    the choices, the JSON: seconds for a long prompt's logprobs, 20 top each), the server goes on
    answering. The test plugin holds this request's output hook, as such a body holds the stage."""
    hold = tmp_path / "out"
    body = {
        "input_ids": [1, 2, 3],
        "rid": f"{HOLD_OUTPUT}{hold}",
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    sender, outcome = _held(server, hold, body, route="/generate")
    try:
        assert http(server, "GET", "/health", key=None, timeout=30).status_code == 200
        other = http(
            server,
            "POST",
            "/generate",
            timeout=30,
            json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
        )
        assert other.status_code == 200 and other.json()["meta_info"]["completion_tokens"] >= 1, (
            other.text
        )
        # answered while the first answer's stage still waited
        assert sender.is_alive() and not outcome
    finally:
        hold.with_suffix(".release").touch()
        sender.join(60)
    answer = outcome["response"].json()
    assert (
        answer["meta_info"]["id"] == body["rid"]
        and len(answer["meta_info"]["output_token_logprobs"]) == 2
    ), answer


def test_a_client_leaving_while_its_prompt_is_tokenized_aborts_it(server, tmp_path):
    """The submission finishes on its worker thread after the client left: its request is aborted then."""
    before = _wait_idle(server)
    hold = tmp_path / "gone"
    body = json.dumps(
        {
            "model": "smol",
            "prompt": f"{HOLD}{hold}\nTell me everything.",
            "max_tokens": 2000,
            "ignore_eos": True,
        }
    ).encode()
    url = httpx.URL(server.url)
    # a raw client, to leave at a known moment
    client = socket.create_connection((url.host, url.port), timeout=60)
    try:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (url.host.encode(), KEY.encode(), len(body), body)
        )
        deadline = time.monotonic() + 60
        while not hold.with_suffix(".entered").exists():  # its prompt is held in the tokenizer
            assert time.monotonic() < deadline, "the held prompt never reached the tokenizer"
            time.sleep(0.01)
    finally:
        client.close()  # gone, with its prompt still held
        hold.with_suffix(
            ".release"
        ).touch()  # even when an assertion failed: the submit worker is shared
    deadline = time.monotonic() + 60
    while (
        _stats(server)["aborted_requests"] == before["aborted_requests"]
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    stats = _wait_idle(server)
    assert engine_idle(stats) and stats["aborted_requests"] == before["aborted_requests"] + 1, stats
    assert stats["generated_tokens"] - before["generated_tokens"] < 1000


def _metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    # the key holds here too (--open-metrics lifts it)
    assert http(server, "GET", "/metrics", key=None).status_code == 401
    r = http(server, "GET", "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_metrics_move_as_requests_finish(server, client):
    before = _metrics(server)
    out = client.completions.create(
        model="smol",
        prompt="Metrics, please:",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = _metrics(server)
    assert (
        after["engine:generation_tokens_total"] - before.get("engine:generation_tokens_total", 0)
        == 7
    )
    assert (
        after["engine:prompt_tokens_total"] - before.get("engine:prompt_tokens_total", 0)
        == out.usage.prompt_tokens
    )
    key = "engine:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    for hist in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        name = f"engine:{hist}_count"
        assert after[name] - before.get(name, 0) == 1, hist
    assert after["engine:num_requests_running"] == 0 and after["engine:num_requests_waiting"] == 0
    assert 0 < after["engine:kv_cache_usage_perc"] <= 1  # the prefix cache holds what ran
    assert 0 <= after["engine:prefix_cache_hit_rate"] <= 1


def test_metrics_count_a_prompt_once_and_never_a_request_never_sent(server, client):
    """n > 1: the prompt once, as usage says; a request a plugin refused before it was sent (the
    engine tells the metrics plugin it ended, with an error) is no finished request at all."""
    before = _metrics(server)
    out = client.completions.create(
        model="smol", prompt="Three guesses:", max_tokens=2, temperature=1.0, n=3
    )
    after = _metrics(server)
    assert (
        after["engine:prompt_tokens_total"] - before["engine:prompt_tokens_total"]
        == out.usage.prompt_tokens
    )
    assert (
        after["engine:generation_tokens_total"] - before["engine:generation_tokens_total"]
        == out.usage.completion_tokens
    )
    r = http(
        server, "POST", "/v1/completions", json={"prompt": UNSENT + " please", "max_tokens": 2}
    )
    assert r.status_code == 500 and "HookError" in r.json()["error"]["message"], r.text
    final = _metrics(server)
    success = {k: v for k, v in final.items() if k.startswith("engine:request_success_total")}
    assert success == {
        k: v for k, v in after.items() if k.startswith("engine:request_success_total")
    }
    assert final["engine:prompt_tokens_total"] == after["engine:prompt_tokens_total"]


def test_the_queue_time_histogram_never_goes_down(monkeypatch):
    """It was the sum over the live engines read at each scrape: an engine shut down, or one whose
    get_stats failed once, took its counts away, and Prometheus read the drop as a counter reset."""
    import engine.frontend.engine as frontend_engine
    from engine.plugins import metrics

    class Fake:
        def __init__(self, n: int) -> None:
            self.n, self.fail = n, False

        def get_stats(self) -> dict:
            if self.fail:
                raise TimeoutError("no answer in time")
            queue = {
                "counts": [self.n] + [0] * len(metrics.QUEUE_BUCKETS),
                "sum": 0.01 * self.n,
                "count": self.n,
            }
            return {"plugins": {"scheduler": {"metrics": {"queue_time": queue}}}}

    a, b = Fake(3), Fake(5)
    live = [a, b]
    monkeypatch.setattr(frontend_engine, "live_engines", lambda: list(live))
    monkeypatch.setattr(metrics, "_queue_seen", {}, raising=False)
    monkeypatch.setattr(
        metrics,
        "_queue_gone",
        {"counts": [0] * (len(metrics.QUEUE_BUCKETS) + 1), "sum": 0.0, "count": 0},
        raising=False,
    )

    def count() -> float:
        family = next(
            f
            for f in metrics._ScrapeCollector().collect()
            if f.name == "engine:request_queue_time_seconds"
        )
        return next(s.value for s in family.samples if s.name.endswith("_count"))

    assert count() == 8
    b.fail = True
    assert count() == 8  # b could not be read: its last figures stand in
    live.remove(a)
    assert count() == 8  # a shut down: its figures stay
    b.fail, b.n = False, 6
    assert count() == 9


def test_grafana_dashboard_queries_only_exported_metrics(server):
    dashboard = json.loads(
        (Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    exported = set(_metrics(server))
    names = {n.split("{")[0] for n in exported}
    used = {m for e in exprs for m in re.findall(r"engine:[a-zA-Z0-9_:]+", e)}
    assert used and used <= names, used - names
    families = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in names}
    core = {
        "engine:num_requests_running",
        "engine:num_requests_waiting",
        "engine:kv_cache_usage_perc",
        "engine:prefix_cache_hit_rate",
        "engine:prompt_tokens",
        "engine:generation_tokens",
        "engine:request_success",
        "engine:time_to_first_token_seconds",
        "engine:time_per_output_token_seconds",
        "engine:e2e_request_latency_seconds",
        "engine:request_queue_time_seconds",
    }
    assert core <= families, core - families
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", m) for m in used}
    assert core <= shown, core - shown  # every core metric has a panel


def test_native_generate_and_flush_cache(server, engine):
    r = http(server, "POST", "/generate", json={"text": "The sky is", "sampling_params": GREEDY})
    assert (
        r.status_code == 200 and r.json()["text"] == engine.generate("The sky is", GREEDY)["text"]
    )
    with httpx.stream(
        "POST",
        server.url + "/generate",
        json={"text": "The sky is", "sampling_params": GREEDY, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    # SGLang: text so far
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == r.json()["text"]
    # the answers just cached
    assert http(server, "POST", "/flush_cache").json()["flushed_tokens"] > 0
    assert http(server, "GET", "/stats").json()["cache_tokens"] == 0


def test_native_stream_events_hold_everything_so_far(server):
    """Each /generate event, as SGLang sends them, holds the request so far: its text, ids, token counts and
    logprobs (not only the event's own); the last one is the whole plain answer."""
    body = {
        "text": "The sky is",
        "sampling_params": {**GREEDY, "max_new_tokens": 6},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    whole = http(server, "POST", "/generate", json=body).json()
    with httpx.stream(
        "POST",
        server.url + "/generate",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as s:
        events = [
            json.loads(line[6:])
            for line in s.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert len(events) > 1
    for e in events:
        meta, n = e["meta_info"], len(e["output_ids"])
        assert (
            meta["prompt_tokens"] == whole["meta_info"]["prompt_tokens"]
            and meta["completion_tokens"] == n
        ), meta
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == n, meta
        assert [t[1] for t in meta["output_token_logprobs"]] == e["output_ids"]
    assert events[-1]["output_ids"] == whole["output_ids"] and events[-1]["text"] == whole["text"]
    last, ref = (
        events[-1]["meta_info"]["output_token_logprobs"],
        whole["meta_info"]["output_token_logprobs"],
    )
    assert [t[1] for t in last] == [t[1] for t in ref]
    # another prefill's shapes
    assert [t[0] for t in last] == pytest.approx([t[0] for t in ref], abs=1e-4)


def test_a_chat_template_that_refuses_the_messages_is_a_400_not_a_500(engine):
    """Many models' templates raise on some role orders (raise_exception): that is the caller's error."""
    import copy

    from engine.frontend.tokenize_stage import render_chat

    tokenizer = copy.copy(engine.tokenizer)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(
        ValueError, match="messages: the model's chat template refused them: roles must alternate"
    ):
        render_chat(tokenizer, CHAT)


# ------------------------------------------------------------------ beam search (issue 15)


def test_beam_search_as_extra_body_fields_equals_engine_beam_search(client, engine):
    ref = engine.beam_search(
        CHAT[0]["content"], beam_width=4, max_new_tokens=12, num_return_sequences=2
    )
    out = client.completions.create(
        model="smol",
        prompt=CHAT[0]["content"],
        max_tokens=12,
        n=2,
        extra_body={"use_beam_search": True, "beam_width": 4},
    )
    assert [c.text for c in out.choices] == [h["text"] for h in ref["hypotheses"]]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(h["output_ids"]) for h in ref["hypotheses"])
    # a grammar with one token path gives one hypothesis of the n: choice indexes still say the prompt
    few = client.completions.create(
        model="smol",
        prompt=["Say a", "Say it"],
        max_tokens=4,
        n=2,
        extra_body={"use_beam_search": True, "regex": "a"},
    )
    assert [(c.index, c.text) for c in few.choices] == [(0, "a"), (2, "a")]
    chat_ref = engine.beam_search(
        messages=CHAT, beam_width=3, max_new_tokens=10, length_penalty=0.5, early_stopping=True
    )
    chat = client.chat.completions.create(
        model="smol",
        messages=CHAT,
        max_tokens=10,
        extra_body={
            "use_beam_search": True,
            "beam_width": 3,
            "length_penalty": 0.5,
            "early_stopping": True,
        },
    )
    assert chat.choices[0].message.content == chat_ref["hypotheses"][0]["text"]
    expected = "stop" if chat_ref["hypotheses"][0]["finish_reason"]["type"] == "stop" else "length"
    assert chat.choices[0].finish_reason == expected


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"use_beam_search": True, "temperature": 0.8}, "temperature"),
        ({"use_beam_search": True, "stream": True}, "stream"),
        ({"use_beam_search": True, "n": 5, "beam_width": 2}, "beam_width"),
        ({"use_beam_search": True, "beam_width": 0}, "beam_width"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
        # 0 asks for logprobs too: not silently dropped
        (
            {"use_beam_search": True, "logprobs": 0},
            "logprobs",
        ),
    ],
)
def test_bad_beam_search_bodies_are_400s_naming_the_field(server, extra, param):
    body = {"model": "smol", "prompt": "Hello", "max_tokens": 4, **extra}
    r = http(server, "POST", "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"], r.json()


# ------------------------------------------------------------------ structured output (issue 16)


def test_response_format_and_regex_over_http(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="smol",
        messages=CHAT,
        max_tokens=64,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": schema, "strict": True},
        },
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(
        model="smol",
        messages=CHAT,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    phone = client.completions.create(
        model="smol",
        prompt="Call me at",
        max_tokens=12,
        temperature=0,
        extra_body={"regex": r" [0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text)


@pytest.mark.parametrize(
    "extra,param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
        ),
        ({"regex": "(("}, "regex"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one"),
    ],
)
def test_bad_constraints_over_http_are_400s(server, extra, param):
    r = http(
        server,
        "POST",
        "/v1/completions",
        json={"model": "smol", "prompt": "Hi", "max_tokens": 4, **extra},
    )
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"] or r.json()["error"].get("param") == param, (
        r.json()
    )


# ------------------------------------------------------------------ issue 49: logprobs 0, vLLM's and SGLang's fields


def test_completions_logprobs_0_give_the_chosen_token_alone(client):
    """logprobs: 0 asks for the chosen tokens' logprobs and no alternatives: each position's
    top_logprobs is {chosen: logprob}, as OpenAI's and vLLM's servers answer (it was null)."""
    kwargs = dict(model="smol", prompt="The sky is", max_tokens=4, temperature=0, logprobs=0)
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert len(lp.tokens) == 4 and lp.top_logprobs == [
        {t: v} for t, v in zip(lp.tokens, lp.token_logprobs)
    ]
    pieces = [
        c.choices[0].logprobs
        for c in client.completions.create(**kwargs, stream=True)
        if c.choices[0].logprobs
    ]
    tops = [t for p in pieces for t in p.top_logprobs]
    assert [list(t) for t in tops] == [list(t) for t in lp.top_logprobs]
    assert [v for t in tops for v in t.values()] == pytest.approx(lp.token_logprobs, abs=1e-4)


def _sse(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(server, tokenizer):
    """vLLM's stream_options.continuous_usage_stats, which guidellm and other clients written for vLLM
    send (it was a 400): every chunk carries its choice's usage so far; include_usage still adds the
    request's usage as the last chunk."""
    body = {
        "model": "smol",
        "messages": CHAT,
        "max_tokens": 5,
        "temperature": 0,
        "n": 2,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _sse(http(server, "POST", "/v1/chat/completions", json=body))
    assert all(c.get("usage") for c in chunks) and chunks[-1]["choices"] == []
    final = chunks[-1]["usage"]
    assert final["completion_tokens"] == 10 and final["total_tokens"] == final["prompt_tokens"] + 10
    so_far = {0: [], 1: []}
    for c in chunks[:-1]:
        u = c["usage"]
        assert (
            u["prompt_tokens"] == final["prompt_tokens"]
            and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        )
        so_far[c["choices"][0]["index"]].append(u["completion_tokens"])
    for (
        counts
    ) in so_far.values():  # the role chunk first (no tokens yet), then each choice's tokens so far
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 5

    prompts = ["The sky is", "Once upon a time, in a land"]
    body = {
        "model": "smol",
        "prompt": prompts,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    chunks = _sse(http(server, "POST", "/v1/completions", json=body))
    # no include_usage: no usage-only last chunk
    assert all(c["choices"] and c["usage"] for c in chunks)
    last = {c["choices"][0]["index"]: c["usage"] for c in chunks}
    assert [last[i]["prompt_tokens"] for i in (0, 1)] == [len(tokenizer.encode(p)) for p in prompts]
    assert [last[i]["completion_tokens"] for i in (0, 1)] == [4, 4]


def test_vllm_and_sglang_names_for_what_the_engine_does(client):
    """Fields that clients written for vLLM or SGLang send, and that the engine can do (each was a 400):
    the matched stop string kept at the end of the text, structured output by their names."""
    kwargs = dict(
        model="smol", prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=40, temperature=0, stop=[" 9"]
    )
    cut = client.completions.create(**kwargs).choices[0]
    assert cut.finish_reason == "stop" and not cut.text.endswith(" 9")
    for name in ("include_stop_str_in_output", "no_stop_trim"):
        kept = client.completions.create(**kwargs, extra_body={name: True}).choices[0]
        assert kept.text == cut.text + " 9" and kept.finish_reason == "stop", name
    streamed = client.completions.create(
        **kwargs, stream=True, extra_body={"include_stop_str_in_output": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.text + " 9"
    chat = dict(model="smol", messages=CHAT, max_tokens=16, temperature=0, stop=[" Paris"])
    cut = client.chat.completions.create(**chat).choices[0]
    assert cut.finish_reason == "stop"
    streamed = client.chat.completions.create(
        **chat, stream=True, extra_body={"no_stop_trim": True}
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed)
        == cut.message.content + " Paris"
    )

    # one request a way of translating (each compiles a grammar: seconds); the names' mapping below
    odd = ["a.b", "(x)|y", "back\\slash", "sp ace"]  # each choice is itself, not a regex
    out = client.completions.create(
        model="smol",
        prompt="Pick one:",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_choice": odd},
    )
    assert out.choices[0].text in odd
    yes_no = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    out = client.chat.completions.create(
        model="smol",
        messages=yes_no,
        max_tokens=4,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    )
    assert out.choices[0].message.content in ("yes", "no")
    schema = {
        "type": "object",
        "properties": {"blue": {"type": "boolean"}},
        "required": ["blue"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="smol",
        messages=yes_no,
        max_tokens=16,
        temperature=0,
        extra_body={"guided_json": schema},
    )
    assert isinstance(json.loads(out.choices[0].message.content)["blue"], bool)


def test_vllm_and_sglang_constraint_names_become_the_engines():
    """Each of vLLM's and SGLang's names for structured output, as the engine's parameter (over HTTP
    each costs a grammar compile: one of each kind is sent above)."""
    from engine.serve.protocol import ChatCompletionRequest
    from engine.serve.translate import choice_regex, sampling_params

    schema, ebnf = {"type": "object"}, 'root ::= "a"'
    for extra, engine_param in [
        ({"guided_json": schema}, {"json_schema": schema}),
        ({"json_schema": '{"type": "object"}'}, {"json_schema": '{"type": "object"}'}),
        ({"guided_regex": "(yes|no)"}, {"regex": "(yes|no)"}),
        ({"guided_grammar": ebnf}, {"ebnf": ebnf}),
        ({"guided_choice": ["a", "b"]}, {"regex": "(a|b)"}),
        ({"structured_outputs": {"json": schema}}, {"json_schema": schema}),
        ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
        ({"structured_outputs": {"choice": ["a"]}}, {"regex": "(a)"}),
        ({"structured_outputs": {"grammar": ebnf}}, {"ebnf": ebnf}),
        ({"structured_outputs": {"json_object": True}}, {"json_schema": {"type": "object"}}),
        ({"structured_outputs": {"json_object": False}}, {}),
        ({"response_format": {"type": "text"}}, {}),
    ]:
        params = sampling_params(ChatCompletionRequest(messages=CHAT, max_tokens=4, **extra))
        assert {
            k: params[k] for k in ("json_schema", "regex", "ebnf") if k in params
        } == engine_param, extra
    assert (
        choice_regex(["a.b", "(x)|y", "back\\slash", "-/"]) == r"(a\.b|\(x\)\|y|back\\slash|\-\/)"
    )


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_json": {"type": "objekt"}}, "guided_json"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"guided_json": {"type": "object"}, "regex": "a"}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        # without stream: true, as include_usage
        (
            {"stream_options": {"continuous_usage_stats": True}},
            None,
        ),
    ],
)
def test_bad_vllm_and_sglang_constraints_are_400s_naming_the_field(server, extra, param):
    r = http(
        server,
        "POST",
        "/v1/completions",
        json={"model": "smol", "prompt": "Hi", "max_tokens": 4, **extra},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and (param is None or param in error["message"]), error
    assert "_new_tokens" not in r.text and "Traceback" not in r.text


def test_other_servers_fields_are_ignored_with_a_warning_or_refused(server):
    """vLLM's and SGLang's fields the engine has no use for: those that only say where or how a request
    runs there are taken and logged (as vLLM does for unknown fields); those whose ignoring would change
    the answer are a 400 naming the field, unless they ask for nothing. docs/server.md lists them all."""
    from engine.serve.protocol import (
        IGNORED_FIELDS,
        REFUSED_CHAT,
        REFUSED_COMPLETIONS,
        REFUSED_FIELDS,
    )

    ignored = {
        "priority": 3,
        "request_id": "mine-1",
        "kv_transfer_params": {"do_remote_decode": False},
        "mm_processor_kwargs": {},
        "stream_interval": 4,
        "session_id": None,
    }
    r = http(
        server, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **ignored}
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while "ignored parameter(s)" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    warned = [line for line in server.lines if "ignored parameter(s)" in line]
    assert (
        warned
        and "ignored parameter(s) kv_transfer_params, mm_processor_kwargs, priority, request_id, "
        "stream_interval "
        in warned[-1]
    ), warned

    for path, refused, base in (
        ("/v1/chat/completions", {**REFUSED_FIELDS, **REFUSED_CHAT}, {"messages": CHAT}),
        ("/v1/completions", {**REFUSED_FIELDS, **REFUSED_COMPLETIONS}, {"prompt": "Hi"}),
    ):
        for name in refused:
            r = http(server, "POST", path, json={**base, "max_tokens": 1, name: 7})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (path, name, r.text)
            assert r.json()["error"]["message"].startswith(f"{name} is not supported"), r.text
        nothing = {name: ok[0] if ok else None for name, ok in refused.items()}
        r = http(server, "POST", path, json={**base, "max_tokens": 1, **nothing})
        assert r.status_code == 200, (path, r.text)
    assert (
        http(
            server, "POST", "/v1/completions", json={"prompt": "Hi", "add_generation_prompt": True}
        ).status_code
        == 400
    )

    docs = (Path(TESTS_DIR).parent / "docs" / "server.md").read_text()
    listed = set(
        re.findall(
            r"`([a-z_]+)`", docs.split("## vLLM's and SGLang's fields", 1)[1].split("\n## ", 1)[0]
        )
    )
    assert {*IGNORED_FIELDS, *REFUSED_FIELDS, *REFUSED_CHAT, *REFUSED_COMPLETIONS} <= listed


def test_guidellm_runs_against_the_server_and_counts_tokens_as_the_engine_does(server, tmp_path):
    """A third-party load generator, as its users run it: guidellm (written for vLLM) streams chat with
    stream_options.continuous_usage_stats, max_completion_tokens, ignore_eos and text-part contents.
    Every request failed (a 400). Now every one succeeds, and the token counts guidellm reports (from
    usage) are the chat template's tokens of each prompt, the tokens it asked for, and what the engine's
    own counters saw. It reads the model's tokenizer from the engine's model folder, offline."""
    from transformers import AutoTokenizer

    from engine.model.resolve import resolve_model_dir

    model_dir, requests, new_tokens = resolve_model_dir(None, announce=None), 24, 8
    # nothing downloaded, nothing cached outside tmp_path; one worker process runs the 8 streams (its
    # default spawns one a stream, each importing guidellm anew: seconds of the 2 cores)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
    }
    before = _metrics(server)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "guidellm",
            "run",
            "--disable-console",
            "--backend",
            f"kind=openai_http,target={server.url},api_key={KEY},request_format=/v1/chat/completions",
            "--profile",
            "kind=concurrent,streams=8",
            "--constraint",
            f"kind=max_requests,count={requests}",
            "--data",
            f"kind=synthetic_text,prompt_tokens=24,output_tokens={new_tokens}",
            "--tokenizer",
            f"kind=huggingface_auto,model={model_dir}",
            "--output",
            f"kind=json,path={tmp_path / 'out.json'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = _metrics(server)
    bench = json.loads((tmp_path / "out.json").read_text())["benchmarks"][0]
    assert bench["metrics"]["request_totals"] == {
        "successful": requests,
        "errored": 0,
        "incomplete": 0,
        "total": requests,
    }

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for r in bench["requests"]["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert (
            body["stream_options"]["continuous_usage_stats"]
            and body["max_completion_tokens"] == new_tokens
        )
        messages = [
            {"role": m["role"], "content": "".join(p["text"] for p in m["content"])}
            for m in body["messages"]
        ]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert r["input_metrics"]["text_tokens"] == len(
            tokenizer.encode(prompt, add_special_tokens=False)
        )
        assert r["output_metrics"]["text_tokens"] == new_tokens
    counted = bench["metrics"]
    prompt_sum = sum(r["input_metrics"]["text_tokens"] for r in bench["requests"]["successful"])
    assert counted["prompt_token_count"]["successful"]["total_sum"] == prompt_sum
    assert after["engine:prompt_tokens_total"] - before["engine:prompt_tokens_total"] == prompt_sum
    assert counted["output_token_count"]["successful"]["total_sum"] == requests * new_tokens
    assert (
        after["engine:generation_tokens_total"] - before["engine:generation_tokens_total"]
        == requests * new_tokens
    )

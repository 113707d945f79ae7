"""return_hidden_states, steering and layer_taps over HTTP: a real `engine serve` (float32), the real
`openai` client (extra_body) and plain HTTP for /generate. Hidden states decode
(engine/serve/hidden_encoding.py) to exactly what Engine.generate returns in-process; steering
changes the steered request only; bad fields are 400s naming them, and the server serves on."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from engine.serve.hidden_encoding import decode_hidden_states
from server_helpers import start_server, stop_server

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 6, "temperature": 0}
HIDDEN = 576  # SmolLM2-135M
LAYERS = 30
ALL = {"layers": [0, 15, -1], "tokens": "all"}


def steer_vector(seed: int = 0, scale: float = 4.0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(HIDDEN, generator=g) * scale).tolist()


STEER = [{"layer": 10, "vector": steer_vector(), "scale": 2.0}]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-total-tokens", "16384", "--served-model-name", "smol")
    yield srv
    assert stop_server(srv) == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=120)


def assert_same_states(got: dict, want: dict) -> None:
    """Decoded hidden states equal the in-process engine's, bit for bit."""
    assert set(got) == set(want) and got["layers"] == want["layers"]
    assert got["point"] == want["point"]
    for key in ("prompt", "generated"):
        if key in want:
            assert got[key].dtype == torch.float32 and got[key].shape == want[key].shape
            assert torch.equal(got[key], want[key]), key


def test_hidden_states_over_http_equal_engine_generate(server, client, engine):
    ref = engine.generate(PROMPT, GREEDY, return_hidden_states=ALL)
    states = ref["meta_info"]["hidden_states"]
    prompt_len, new = ref["meta_info"]["prompt_tokens"], ref["meta_info"]["completion_tokens"]
    assert states["layers"] == [0, 15, LAYERS - 1] and states["point"] == "resid_post"
    assert states["prompt"].shape == (3, prompt_len, HIDDEN)
    assert states["generated"].shape == (3, new, HIDDEN)

    native = post(
        server,
        "/generate",
        {"text": PROMPT, "sampling_params": GREEDY, "return_hidden_states": ALL},
    )
    assert native.status_code == 200, native.text
    encoded = native.json()["meta_info"]["hidden_states"]
    assert encoded["prompt"]["dtype"] == "float32" and encoded["prompt"]["byteorder"] == "little"
    assert encoded["prompt"]["shape"] == [3, prompt_len, HIDDEN]
    assert native.json()["text"] == ref["text"]
    assert_same_states(decode_hidden_states(encoded), states)

    done = client.completions.create(
        model="smol",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"return_hidden_states": ALL},
    )
    assert done.choices[0].text == ref["text"]
    assert_same_states(decode_hidden_states(done.choices[0].model_extra["hidden_states"]), states)

    chat = [{"role": "user", "content": "Name a colour."}]
    chat_ref = engine.generate(messages=chat, sampling_params=GREEDY, return_hidden_states=True)
    answer = client.chat.completions.create(
        model="smol",
        messages=chat,
        max_tokens=6,
        temperature=0,
        extra_body={"return_hidden_states": True},
    )
    got = decode_hidden_states(answer.choices[0].model_extra["hidden_states"])
    assert got["prompt"].shape == (1, 1, HIDDEN) and got["layers"] == [LAYERS - 1]
    assert_same_states(got, chat_ref["meta_info"]["hidden_states"])

    plain = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0)
    assert "hidden_states" not in (plain.choices[0].model_extra or {})  # only when asked for


def test_stop_strings_end_requests_with_their_hidden_states(server, client, engine):
    """A stop string ends the request in the detokenizer: its generated rows stop at the match."""
    params = {"max_new_tokens": 16, "temperature": 0}
    whole = engine.generate(PROMPT, params)
    stop = whole["text"].split()[2]  # a word some tokens in
    ref = engine.generate(
        PROMPT,
        dict(params, stop=[stop]),
        return_hidden_states={"layers": [3], "tokens": "generated"},
    )
    n = ref["meta_info"]["completion_tokens"]
    assert 0 < n < 16 and ref["meta_info"]["hidden_states"]["generated"].shape == (1, n, HIDDEN)
    done = client.completions.create(
        model="smol",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"return_hidden_states": {"layers": [3], "tokens": "generated"}},
    )
    assert done.choices[0].finish_reason == "stop" and done.choices[0].text == ref["text"]
    assert done.usage.completion_tokens == n
    got = decode_hidden_states(done.choices[0].model_extra["hidden_states"])
    assert_same_states(got, ref["meta_info"]["hidden_states"])


def test_streams_carry_hidden_states_on_the_last_chunk_only(server, client):
    asked = {"layers": [-1], "tokens": "generated"}
    whole = client.completions.create(
        model="smol",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"return_hidden_states": asked},
    )
    want = decode_hidden_states(whole.choices[0].model_extra["hidden_states"])
    assert want["generated"].shape == (1, whole.usage.completion_tokens, HIDDEN)
    chunks = list(
        client.completions.create(
            model="smol",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"return_hidden_states": asked},
        )
    )
    carrying = [c for c in chunks if "hidden_states" in (c.choices[0].model_extra or {})]
    assert len(chunks) > 1 and carrying == [chunks[-1]] and chunks[-1].choices[0].finish_reason
    assert_same_states(
        decode_hidden_states(carrying[0].choices[0].model_extra["hidden_states"]), want
    )

    body = {
        "text": PROMPT,
        "sampling_params": GREEDY,
        "stream": True,
        "return_hidden_states": asked,
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(events) > 1
    assert all("hidden_states" not in e["meta_info"] for e in events[:-1])
    assert_same_states(decode_hidden_states(events[-1]["meta_info"]["hidden_states"]), want)


def test_steering_over_http_changes_only_the_steered_request(server, client, engine):
    plain = engine.generate(PROMPT, GREEDY)["text"]
    steered = engine.generate(PROMPT, GREEDY, steering=STEER)["text"]
    assert steered != plain  # the vector is strong enough to change greedy tokens

    def complete(extra: dict) -> list[str]:
        out = client.completions.create(
            model="smol", prompt=PROMPT, max_tokens=6, temperature=0, n=2, extra_body=extra
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    # the steered and unsteered requests at once, so they share batches
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, {"steering": STEER} if i % 2 else {}) for i in range(4)]
        texts = [f.result() for f in futures]
    for i, got in enumerate(texts):
        assert got == ([steered] * 2 if i % 2 else [plain] * 2), i

    native = post(
        server, "/generate", {"text": PROMPT, "sampling_params": GREEDY, "steering": STEER}
    )
    assert native.status_code == 200 and native.json()["text"] == steered
    chat = [{"role": "user", "content": "Name a colour."}]
    chat_plain = engine.generate(messages=chat, sampling_params=GREEDY)["text"]
    chat_steered = engine.generate(messages=chat, sampling_params=GREEDY, steering=STEER)["text"]
    answer = client.chat.completions.create(
        model="smol", messages=chat, max_tokens=6, temperature=0, extra_body={"steering": STEER}
    )
    assert answer.choices[0].message.content == chat_steered != chat_plain


NAN_VECTOR = '{"prompt": "Hi", "max_tokens": 2, "steering": [{"layer": 1, "vector": [NaN%s]}]}' % (
    ", 0.0" * (HIDDEN - 1)
)
# (body fields, the param the error names); the first eight are the engine's checks, the rest pydantic's
BAD = [
    ({"return_hidden_states": {"layers": [LAYERS]}}, "return_hidden_states.layers"),
    ({"return_hidden_states": {"tokens": "some"}}, "return_hidden_states.tokens"),
    ({"steering": [{"layer": -LAYERS - 1, "vector": [0.0] * HIDDEN}]}, "steering.0.layer"),
    ({"steering": [{"layer": 2, "vector": [0.0] * (HIDDEN - 1)}]}, "steering.0.vector"),
    ({"steering": [{"layer": 2, "vector": "no-such-vector"}]}, "steering.0.vector"),
    ({"layer_taps": ["no-such-tap"]}, "layer_taps"),
    (
        {
            "return_hidden_states": {"layers": list(range(LAYERS)), "tokens": "generated"},
            "max_tokens": 2000,
        },
        "return_hidden_states",
    ),
    ({"return_hidden_states": "yes"}, "return_hidden_states"),
    ({"steering": [{"layer": "2", "vector": [0.0] * HIDDEN}]}, "steering.0.layer"),
    ({"steering": [{"layer": 2, "vector": [0.0] * HIDDEN, "bias": 1}]}, "steering.0.bias"),
    ({"layer_taps": "lens"}, "layer_taps"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_layer_fields_are_400s_naming_the_field(server, client, fields, param):
    from openai import BadRequestError

    sampling = {"max_tokens": fields.get("max_tokens", 2), "stop": fields.get("stop")}
    extra = {k: v for k, v in fields.items() if k not in sampling}
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model="smol", prompt="Hi", **sampling, extra_body=extra)
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split(".")[0] in error["message"]

    native_sampling = {"max_new_tokens": sampling["max_tokens"], "stop": sampling["stop"]}
    body = {"text": "Hi", "sampling_params": native_sampling, **extra}
    native = post(server, "/generate", body)
    assert native.status_code == 400 and param.split(".")[0] in native.json()["error"]["message"]


def test_the_server_serves_after_refusals(server, client, engine):
    refused = post(server, "/v1/completions", NAN_VECTOR)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "steering.0.vector", error
    done = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0)
    assert done.choices[0].text == engine.generate(PROMPT, GREEDY)["text"]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_beam_search_choices_carry_their_own_hypothesis_states(server, client, engine):
    """use_beam_search with return_hidden_states "all": choice j carries the prompt's rows and the
    generated rows of hypothesis j, as Engine.beam_search returns them."""
    ref = engine.beam_search(
        PROMPT, beam_width=3, max_new_tokens=6, num_return_sequences=2, return_hidden_states=ALL
    )
    states = ref["meta_info"]["hidden_states"]
    out = client.completions.create(
        model="smol",
        prompt=PROMPT,
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "beam_width": 3, "return_hidden_states": ALL},
    )
    assert [c.text for c in out.choices] == [h["text"] for h in ref["hypotheses"]]
    for j, (choice, hyp) in enumerate(zip(out.choices, ref["hypotheses"])):
        got = decode_hidden_states(choice.model_extra["hidden_states"])
        assert got["generated"].shape == (3, len(hyp["output_ids"]), HIDDEN)
        assert_same_states(got, {**states, "generated": states["generated"][j]})

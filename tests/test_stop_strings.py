"""Issue 13, items 2 and 3: stop strings against min_new_tokens.

The matcher is driven as the detokenizer drives it (release before min_new_tokens, feed after, final
on the last output) and compared with a plain reference over many random token splits. The
detokenizer itself, in-process on real sockets, must flush held text on a final output."""

from __future__ import annotations

import random

import pytest
import zmq

from engine.detokenizer.stop_strings import StopMatcher


def reference(pieces: list[str], stops: tuple[str, ...], min_new: int) -> tuple[str, str | None]:
    """The rule, from the whole text: the occurrence that ends first (longest on a tie), among those
    ending after the text of the first min_new - 1 tokens."""
    text = "".join(pieces)
    boundary = len("".join(pieces[: max(min_new - 1, 0)]))
    for end in range(boundary + 1, len(text) + 1):
        hits = [s for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def streamed(pieces: list[str], stops: tuple[str, ...], min_new: int) -> tuple[str, str | None]:
    """What the detokenizer releases, piece by piece, as in DetokenizerManager._match_stop_strings."""
    m = StopMatcher(stops)
    out = ""
    for i, piece in enumerate(pieces):
        final = i == len(pieces) - 1
        if i + 1 < min_new:
            out += m.release(piece, final)
            continue
        text, matched = m.feed(piece, final)
        out += text
        if matched is not None:
            return out, matched
    return out, None


def _random_case(rng: random.Random):
    alphabet = rng.choice(["ab", "ab\n", "abc", "\n."])
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
    stops = tuple(
        {
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        }
    )
    cuts = (
        sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
        if len(text) > 1
        else []
    )
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    # tokens with no text (a partial UTF-8 character, a skipped special token)
    if rng.random() < 0.2:
        pieces.insert(rng.randrange(len(pieces) + 1), "")
    return pieces, stops, rng.randint(0, len(pieces) + 2)


def test_matcher_agrees_with_the_reference_over_random_splits():
    rng = random.Random(13)
    for case in range(20000):
        pieces, stops, min_new = _random_case(rng)
        assert streamed(pieces, stops, min_new) == reference(pieces, stops, min_new), (
            case,
            pieces,
            stops,
            min_new,
        )


@pytest.mark.parametrize(
    "pieces, min_new, expected",
    [
        # "\n" came before min_new_tokens: it does not stop
        (
            ["a", "\n", "x", "y"],
            3,
            ("a\nxy", None),
        ),
        # "\n\n" ends after the boundary: it stops, whole
        (
            ["a", "\n", "\n", "y"],
            3,
            ("a", "\n\n"),
        ),
        (["a", "\n", "x", "\n"], 3, ("a\nx", "\n")),
    ],
)
def test_stop_string_completed_before_min_new_tokens_does_not_stop_later(pieces, min_new, expected):
    assert streamed(pieces, ("\n", "\n\n"), min_new) == expected


def test_final_output_flushes_held_text_before_min_new_tokens():
    assert streamed(["Hello", "\n"], ("\n\n",), 10) == ("Hello\n", None)


@pytest.fixture()
def detokenizer(model_dir):
    """A DetokenizerManager in this process, its peers' sockets bound here."""
    from engine.detokenizer.manager import DetokenizerManager
    from engine.ipc.channels import Endpoints, pull_socket

    endpoints = Endpoints.create()
    ctx = zmq.Context()
    peers = [pull_socket(ctx, endpoints.tokenizer), pull_socket(ctx, endpoints.scheduler)]
    manager = DetokenizerManager(model_dir, endpoints.to_dict())
    yield manager
    for sock in (manager.recv_sock, manager.send_sock, manager.scheduler_sock):
        sock.close(linger=0)
    manager.zmq_ctx.term()
    for sock in peers:
        sock.close(linger=0)
    ctx.term()
    endpoints.remove()


@pytest.mark.parametrize("reason", ["length", "abort"])
def test_detokenizer_flushes_held_text_when_a_request_ends_before_min_new_tokens(
    detokenizer, tokenizer, reason
):
    from engine.ipc.messages import BatchTokenOut, FinishReason, RequestHeader, RequestMeta

    ids = tokenizer.encode("Hello world.\n")
    assert len(ids) >= 2 and tokenizer.decode(ids[-1:]).endswith("\n")
    header = RequestHeader(prompt_tokens=3, stop=("\n\n",), min_new_tokens=len(ids) + 5)
    text = ""
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        finish = (
            (
                FinishReason("length", length=len(ids))
                if reason == "length"
                else FinishReason("abort", message="x")
            )
            if last
            else None
        )
        out = BatchTokenOut(
            ["r"],
            [token],
            [finish],
            [RequestMeta(3, i + 1) if last else None],
            [header if i == 0 else None],
        )
        text += detokenizer.detokenize(out).text_deltas[0]
    assert text == "Hello world.\n"
    assert not detokenizer.stop_states


def test_held_text_reaches_the_caller_when_a_batch_fails(detokenizer, tokenizer, monkeypatch):
    """A batch the detokenizer fails (a plugin's hook, any exception) ends its requests with an abort:
    the text held back for a stop string that had not completed was dropped with them, though held text
    always reaches the caller when a request ends without a match."""
    from engine.hooks import HookError
    from engine.ipc.messages import BatchTokenOut, RequestHeader

    ids = tokenizer.encode("Hello wor", add_special_tokens=False)
    header = RequestHeader(prompt_tokens=3, stop=("world",))
    text = ""
    for i, token in enumerate(ids):
        out = BatchTokenOut(["r"], [token], [None], [None], [header if i == 0 else None])
        text += detokenizer.detokenize(out).text_deltas[0]
    assert text == "Hello "  # "wor" may start the stop string: held

    def fail(*args, **kwargs):
        raise HookError("a_plugin", "engine_detokenize", RuntimeError("boom"))

    monkeypatch.setattr(detokenizer, "_decode", fail)
    last = detokenizer.detokenize(
        BatchTokenOut(
            ["r"], [tokenizer.encode("!", add_special_tokens=False)[0]], [None], [None], [None]
        )
    )
    assert last.finished[0].type == "abort" and text + last.text_deltas[0] == "Hello wor"
    assert not detokenizer.stop_states


def test_min_new_tokens_is_clipped_with_max_new_tokens(tiny_engine):
    """A prompt near the context end: max_new_tokens shrinks to the room left, min_new_tokens with it;
    the text held back for a stop string that never completes still reaches the caller."""
    from tiny_engine import CONTEXT

    prompt = [1] + [500 + i for i in range(CONTEXT - 5)]  # room for 4 new tokens
    params = {"max_new_tokens": 50, "min_new_tokens": 40, "temperature": 0}
    tm = tiny_engine._resources.tokenizer_manager
    clipped = tm.submission.validate(prompt, tm.submission.parse_params(params), 0)
    assert (clipped.max_new_tokens, clipped.min_new_tokens) == (4, 4)
    plain = tiny_engine.generate(input_ids=prompt, sampling_params=params)
    assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    last = tiny_engine.tokenizer.decode(plain["output_ids"][-1:])
    assert last, "the last token has no text of its own; pick another prompt"
    out = tiny_engine.generate(
        input_ids=prompt, sampling_params={**params, "stop": [last + "\x00never"]}
    )
    assert out["text"] == plain["text"] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_text_before_min_new_tokens_that_ends_in_half_a_character_cannot_stop(
    detokenizer, tokenizer
):
    """A token ending in half a character (" \\xc3", a space and the first byte of "ä") used to hold its
    complete characters back with the half: the space came out with the next token's text, after
    min_new_tokens, where the stop string " " matched though it ended inside the early tokens' text.
    The complete characters now come out with their own token; "ä", completed after the boundary,
    can still end a stop string."""
    from engine.ipc.messages import BatchTokenOut, FinishReason, RequestHeader, RequestMeta

    vocab = tokenizer.get_vocab()
    # byte-level pieces of "x ä" + "y"
    ids = [
        vocab["x"],
        vocab["Ġ\u00c3"],
        vocab["\u00a4"],
        vocab["y"],
    ]
    assert tokenizer.decode(ids) == "x \u00e4y"

    def run(stop: tuple[str, ...], rid: str) -> tuple[str, list[str], FinishReason | None]:
        header = RequestHeader(prompt_tokens=3, stop=stop, min_new_tokens=3)
        text, deltas, finish = "", [], None
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            out = BatchTokenOut(
                [rid],
                [token],
                [FinishReason("length", length=4) if last else None],
                [RequestMeta(3, i + 1) if last else None],
                [header if i == 0 else None],
            )
            got = detokenizer.detokenize(out)
            if got is None:
                break
            deltas.append(got.text_deltas[0])
            text += got.text_deltas[0]
            finish = got.finished[0] or finish
            if finish is not None:
                break
        return text, deltas, finish

    # the space is the second token's: before the boundary
    text, deltas, finish = run((" ",), "space")
    assert (text, finish.type if finish else None) == ("x \u00e4y", "length"), (text, finish)
    assert deltas[:2] == ["x", " "]  # released with its own token, the half character held
    text, _, finish = run(("\u00e4",), "umlaut")  # "ä" ends in the third token: after it
    assert (text, finish.type, finish.matched) == ("x ", "stop", "\u00e4"), (text, finish)
    assert not detokenizer.stop_states

"""engine/serve/logprobs.py's token texts and bytes, which OpenAI's logprobs carry: all the tokens' bytes
together are the text's UTF-8, for a byte-level vocabulary (SmolLM2's) and a sentencepiece one (Llama 2's
and Mistral's: "▁" for a space, "<0xE3>" byte tokens), whose pieces decoded alone lose their space."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from engine.serve.logprobs import TokenText, chat_logprobs, completion_logprobs

SP_VOCAB = [
    "<unk>",
    "<s>",
    "</s>",
    "<0xE3>",
    "<0x81>",
    "<0x82>",
    "▁Hello",
    "▁world",
    "!",
    "▁",
    "lo",
]
SP_DECODERS = {  # as Llama 2's tokenizer.json writes it, and as newer Mistral files do
    "replace": decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    ),
    "metaspace": decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", "always")]),
}


def sentencepiece_tokenizer(decoder: str) -> PreTrainedTokenizerFast:
    model = models.BPE(
        vocab={p: i for i, p in enumerate(SP_VOCAB)},
        merges=[],
        unk_token="<unk>",
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    tok.decoder = SP_DECODERS[decoder]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("decoder", sorted(SP_DECODERS))
def test_sentencepiece_pieces_keep_their_space_and_byte_tokens_their_byte(decoder):
    tok = sentencepiece_tokenizer(decoder)
    ids = [
        SP_VOCAB.index(p)
        for p in ("▁Hello", "▁world", "!", "<0xE3>", "<0x81>", "<0x82>", "▁", "lo")
    ]
    # as the detokenizer decodes an output: on its own, the first piece's space dropped
    text = tok.decode(ids)
    assert text == "Hello world!あ lo"
    text_of = TokenText(tok)
    assert [text_of(i)[0] for i in ids[1:]] == [
        " world",
        "!",
        "bytes:\\xe3",
        "bytes:\\x81",
        "bytes:\\x82",
        " ",
        "lo",
    ]
    meta = {"output_token_logprobs": [(-0.5, i, None) for i in ids]}
    chat = chat_logprobs(meta, text_of)["content"]
    assert chat[0]["token"] == "Hello" and b"".join(bytes(c["bytes"]) for c in chat) == text.encode(
        "utf-8"
    )
    completion = completion_logprobs(meta, text_of)
    assert completion["tokens"][:2] == ["Hello", " world"] and completion["text_offset"][:3] == [
        0,
        5,
        11,
    ]
    later = chat_logprobs(
        {"output_token_logprobs": meta["output_token_logprobs"][:2]}, text_of, start=3
    )["content"]
    # a stream chunk's tokens after the first
    assert [c["token"] for c in later] == [
        " Hello",
        " world",
    ]


def test_byte_level_tokens_give_the_texts_bytes(engine):
    text = " Hello, world! こんにちは 🙂"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    text_of = TokenText(engine.tokenizer)
    assert b"".join(text_of(i)[1] for i in ids) == text.encode("utf-8")
    # a token holding part of a character
    assert any(t.startswith("bytes:") for t, _ in map(text_of, ids))

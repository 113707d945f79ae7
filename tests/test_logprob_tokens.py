"""engine/serve/logprobs.py's token texts and bytes, which OpenAI's logprobs carry: all the tokens' bytes
together are the text's UTF-8, for a byte-level vocabulary (SmolLM2's) and a sentencepiece one (Llama 2's
and Mistral's: "▁" for a space, "<0xE3>" byte tokens), whose pieces decoded alone lose their space."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from engine.serve.logprobs import TokenText

SP_VOCAB = ["<unk>", "<s>", "</s>", "<0xE3>", "<0x81>", "<0x82>", "▁Hello", "▁world", "!", "▁", "lo"]
SP_DECODERS = {  # as Llama 2's tokenizer.json writes it, and as newer Mistral files do
    "replace": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                  decoders.Strip(" ", 1, 0)]),  # fmt: skip
    "metaspace": decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", "always")]),
}


def sentencepiece_tokenizer(decoder: str) -> PreTrainedTokenizerFast:
    model = models.BPE(vocab={p: i for i, p in enumerate(SP_VOCAB)}, merges=[], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.decoder = SP_DECODERS[decoder]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("decoder", sorted(SP_DECODERS))
def test_sentencepiece_pieces_keep_their_space_and_byte_tokens_their_byte(decoder):
    tok = sentencepiece_tokenizer(decoder)
    ids = [SP_VOCAB.index(p) for p in ("▁Hello", "▁world", "!", "<0xE3>", "<0x81>", "<0x82>", "▁", "lo")]
    text = tok.decode([SP_VOCAB.index("▁Hello"), *ids])[len("Hello"):]  # as a generation after a prompt
    assert text == " Hello world!あ lo"
    text_of = TokenText(tok)
    assert [text_of(i)[0] for i in ids] == [" Hello", " world", "!", "bytes:\\xe3", "bytes:\\x81", "bytes:\\x82", " ", "lo"]
    assert b"".join(text_of(i)[1] for i in ids) == text.encode("utf-8")


def test_byte_level_tokens_give_the_texts_bytes(engine):
    text = " Hello, world! こんにちは 🙂"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    text_of = TokenText(engine.tokenizer)
    assert b"".join(text_of(i)[1] for i in ids) == text.encode("utf-8")
    assert any(t.startswith("bytes:") for t, _ in map(text_of, ids))  # a token holding part of a character


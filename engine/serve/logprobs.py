"""Logprobs in OpenAI's form: each token's own bytes, its text, completions' text offsets.

A byte-level BPE token (GPT-2's alphabet: SmolLM2, Llama 3, Qwen, ...) may hold part of a UTF-8
character; decoding it alone gives U+FFFD, whose bytes are not the token's. Its bytes come from its
vocabulary string instead, GPT-2's byte-to-unicode mapping reversed, so all the tokens' bytes
together are the text's UTF-8. A sentencepiece token's ("▁world") are its piece's with "▁" as the space that
decoding it alone would drop. A token's `token` is its text; one that is not whole characters is
written as OpenAI writes it, "bytes:" and the bytes as \\xNN escapes ("bytes:\\xe3\\x81").
"""

from __future__ import annotations

import codecs
import re
from functools import lru_cache

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable bytes stand for themselves, the others for
    chr(256 + k), k counting them in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + k) for k, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


def as_text(raw: bytes) -> str:
    """A token's `token`: its text, or for part of a character "bytes:" and \\xNN escapes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenText:
    """Token id -> (token, bytes), cached. For a sentencepiece vocabulary (Llama 2, Mistral: "▁" a space,
    "<0xE3>" a byte token) the bytes are the piece's with "▁" as a space, or the byte token's byte: decoding
    a piece alone drops its leading space, which the text in context keeps. Otherwise (not byte-level, not
    sentencepiece) the token decoded alone."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        self.byte_level = "ByteLevel" in decoder
        self.sentencepiece = not self.byte_level and ("Metaspace" in decoder or '"▁"' in decoder)
        # special tokens: plain text
        self.added = {i for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self.cache.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = self.cache[token_id] = (as_text(raw), raw)
        return found

    def at(self, token_id: int, position: int) -> tuple[str, bytes]:
        """(token, bytes) of an output token at its position: the detokenizer decodes the output on its
        own, and a sentencepiece decoder drops the space the first piece (position 0) starts with."""
        token, raw = self(token_id)
        if position == 0 and self.sentencepiece and raw.startswith(b" "):
            return as_text(raw[1:]), raw[1:]
        return token, raw

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self.added:
            if self.byte_level:
                table = byte_decoder()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            else:
                byte = _BYTE_TOKEN.fullmatch(piece)
                if byte:
                    return bytes([int(byte.group(1), 16)])
                if self.sentencepiece:
                    return piece.replace("▁", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")


class TextOffsets:
    """Completions' text_offset: the characters of the text completed before each token (a token
    that finishes a character started by the one before has that one's offset)."""

    def __init__(self) -> None:
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: bytes) -> int:
        at = self.chars
        self.chars += len(self.decoder.decode(raw))
        return at


def chat_logprobs(meta: dict, text_of: TokenText, start: int = 0) -> dict | None:
    """start: the output position of the first token in meta's lists (a stream chunk's own tokens)."""
    tokens = meta.get("output_token_logprobs")
    if tokens is None:
        return None
    tops = meta.get("output_top_logprobs") or [[] for _ in tokens]
    content = []
    for j, ((lp, tid, _), top) in enumerate(zip(tokens, tops)):
        token, raw = text_of.at(tid, start + j)
        alternatives = [
            {"token": text_of(i)[0], "logprob": v, "bytes": list(text_of(i)[1])} for v, i, _ in top
        ]
        content.append(
            {"token": token, "logprob": lp, "bytes": list(raw), "top_logprobs": alternatives}
        )
    return {"content": content}


def completion_logprobs(
    meta: dict, text_of: TokenText, offsets: TextOffsets | None = None, start: int = 0
) -> dict | None:
    """offsets: a stream's, kept from chunk to chunk; a new one (from 0) otherwise. start: as chat_logprobs'."""
    tokens = meta.get("output_token_logprobs")
    if tokens is None:
        return None
    offsets = offsets if offsets is not None else TextOffsets()
    tops = meta.get("output_top_logprobs") or [None for _ in tokens]
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for j, ((lp, tid, _), top) in enumerate(zip(tokens, tops)):
        token, raw = text_of.at(tid, start + j)
        out["tokens"].append(token)
        out["token_logprobs"].append(lp)
        # keyed as `tokens` writes them, and the chosen one too, as OpenAI's: "up to logprobs+1 elements"
        # (with logprobs: 0 the chosen one alone)
        alternatives = {text_of.at(i, start + j)[0]: v for v, i, _ in top or ()}
        alternatives.setdefault(token, lp)
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offsets.next(raw))
    return out

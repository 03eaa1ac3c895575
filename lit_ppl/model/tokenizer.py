"""Tokenizers behind one small interface: the built-in byte tokenizer and any Hugging Face tokenizer."""

from __future__ import annotations

import hashlib
import os
from typing import Protocol

from lit_ppl.errors import LitPplError


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    @property
    def context_id(self) -> int:
        """Token that precedes every document as context only (BOS, else EOS)."""
        ...

    @property
    def adds_bos(self) -> bool:
        """Whether the tokenizer puts a BOS in front of a text it encodes with special tokens (llama.cpp's
        ``add_bos``: ``eval.mode=llamacpp`` puts BOS in place of each chunk's first token only then)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the token store's dtype follows it)."""
        ...

    @property
    def fingerprint(self) -> str:
        """Stable digest of the vocabulary and rules: the tokenization cache key."""
        ...

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens as the tokenizer writes them)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0–255, plus BOS (256) and EOS (257): needs no files, covers any text."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    @property
    def context_id(self) -> int:
        return self.bos_id

    adds_bos = True

    @property
    def fingerprint(self) -> str:
        return "byte-v1"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``transformers`` tokenizer; documents are encoded with ``add_special_tokens=False``.

    This matches lm-evaluation-harness with ``add_bos_token=False``: the BOS that ``rolling`` mode puts in
    front of each document is context only, never part of the document's tokens.
    """

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        # Documents are longer than the model context by design; silence the length warning.
        self.tok.model_max_length = int(1e30)
        ctx = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if ctx is None:
            raise LitPplError(
                f"tokenizer {tokenizer.name_or_path!r} has neither a BOS nor an EOS token; lit-ppl needs one "
                "as the context token in front of each document"
            )
        self._context_id = int(ctx)

    @property
    def context_id(self) -> int:
        return self._context_id

    @property
    def adds_bos(self) -> bool:
        bos = self.tok.bos_token_id
        if bos is None:
            return False
        # What encoding with special tokens does, not a flag: tokenizers set it in different places.
        with_special = self.tok("a", add_special_tokens=True)["input_ids"]
        return len(with_special) > len(self.tok("a", add_special_tokens=False)["input_ids"]) and with_special[0] == bos

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def fingerprint(self) -> str:
        backend = getattr(self.tok, "backend_tokenizer", None)
        spec = backend.to_str() if backend is not None else repr(sorted(self.tok.get_vocab().items()))
        return hashlib.sha256(f"{type(self.tok).__name__}\n{spec}".encode()).hexdigest()[:16]

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, clean_up_tokenization_spaces=False)


def token_pieces(tokenizer: Tokenizer, ids: list[int], context: int = 8) -> list[str]:
    """The text each of ``ids`` adds to the decoded text of those before it, so that the pieces join into the whole.

    Decoding one token alone loses what depends on its neighbours (a SentencePiece word's leading space, the bytes of
    a character split over tokens), so each token is decoded after the ones before it, from an anchor kept between
    ``context`` and ``2 · context`` tokens back (a page costs linear time); a token that ends inside a character adds
    nothing until the one completing it.

    Examples:
        >>> token_pieces(ByteTokenizer(), list("é!".encode()))
        ['', 'é', '!']
    """
    pieces: list[str] = []
    anchor, emitted = 0, ""
    for k in range(len(ids)):
        text = tokenizer.decode(ids[anchor : k + 1])
        if text.endswith("\ufffd") and k + 1 < len(ids):  # a character split over tokens: wait for the rest
            pieces.append("")
            continue
        pieces.append(text[len(os.path.commonprefix([emitted, text])) :])  # noqa: RUF071 (characters are the point)
        emitted = text
        if k + 1 - anchor >= 2 * context:
            anchor = k + 1 - context
            emitted = tokenizer.decode(ids[anchor : k + 1])
    return pieces

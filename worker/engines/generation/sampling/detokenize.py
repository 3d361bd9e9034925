"""Token ids -> text, one token at a time, exactly as `tokenizer.decode(ids, skip_special_tokens=True)` would give.

Two ways, chosen once per tokenizer by `piece_decoders`:
- byte-level BPE (GPT-2, Qwen2/3, Llama 3): each id stands for fixed bytes, fed to an incremental UTF-8
  decoder; a character split across tokens comes out whole once its last byte arrives. No tokenizer call.
- any other fast tokenizer (Metaspace + byte fallback as Llama 2 and Mistral ship, WordPiece, ...): TGI's and
  vLLM's prefix/read offsets. The text of the tokens after the last emitted boundary is decoded with and
  without the newest ones and the difference is emitted, so decoder rules that depend on the neighbours
  (Metaspace dropping the first token's space, Strip, byte-fallback runs) apply as in one whole decode.
  A byte-fallback run (`<0xE2><0x82><0xAC>`) is held back until a non-byte, non-special token ends it: HF
  decodes a run as a whole (one U+FFFD per byte when the run is not valid UTF-8, special tokens removed
  first), so an early guess could be wrong.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import Protocol

from transformers import PreTrainedTokenizerBase

BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


class Pieces(Protocol):
    """Turns a choice's tokens into text pieces that never split a character."""

    def push(self, token_id: int) -> str: ...

    def finish(self) -> str: ...


class BytePieces:
    """Byte-level BPE: the fixed bytes of each token through an incremental UTF-8 decoder."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        """The characters completed by this token."""
        return self._decoder.decode(self._table[token_id])

    def finish(self) -> str:
        """Incomplete bytes at the end, as U+FFFD (as tokenizer.decode does)."""
        return self._decoder.decode(b"", final=True)


class WindowPieces:
    """prefix/read offsets: text(ids[prefix:]) minus text(ids[prefix:read]), emitted once it is settled."""

    def __init__(self, decode: Callable[[list[int]], str], held: frozenset[int]) -> None:
        self._decode = decode
        self._held = held  # byte-fallback and special tokens: wait for the next token that ends a byte run
        self._ids: list[int] = []
        self._prefix = 0  # where the decoded window starts (its first token's text is decoded as a first token)
        self._read = 0  # tokens before this have been emitted

    def push(self, token_id: int) -> str:
        """The text this token settles ("" while it may still change)."""
        self._ids.append(token_id)
        return "" if token_id in self._held else self._advance(final=False)

    def finish(self) -> str:
        """Whatever is still held back."""
        return self._advance(final=True) if self._read < len(self._ids) else ""

    def _advance(self, *, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read]) if self._read > self._prefix else ""
        text = self._decode(self._ids[self._prefix:])
        # A trailing U+FFFD may be half a character that the next token completes.
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids that decode(skip_special_tokens=True) drops: the named specials and every added token marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {index for index, token in added.items() if token.special}


def token_bytes(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[bytes] | None:
    """The exact bytes each token id stands for in a byte-level BPE (special tokens: none); None for others."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # decode() rewrites " ." and the like: only the windowed decoder stays exact
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    added = set(tokenizer.get_added_vocab())
    special = special_ids(tokenizer)
    table = [b""] * vocab_size  # ids past the tokenizer (a padded embedding matrix) decode to nothing
    for token, index in tokenizer.get_vocab().items():
        if index >= vocab_size or index in special:  # skip_special_tokens=True: specials have no text
            continue
        if token in added or any(char not in byte_of for char in token):
            table[index] = token.encode("utf-8")  # added tokens are stored as plain text
        else:
            table[index] = bytes(byte_of[char] for char in token)
    return table


def logprob_table(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[bytes]:
    """Each token id's own bytes, as logprobs report them: the byte-level table, or for SentencePiece-style
    tokenizers the piece with its word marker as a space and `<0xNN>` byte-fallback tokens as that byte."""
    table = token_bytes(tokenizer, vocab_size)
    if table is not None:
        return table
    special = special_ids(tokenizer)
    out = [b""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index >= vocab_size or index in special:
            continue
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out[index] = bytes([int(token[3:5], 16)])
        else:
            out[index] = token.replace("\u2581", " ").encode("utf-8")
    return out


def piece_decoders(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> Callable[[], Pieces]:
    """A factory of per-choice text decoders for this tokenizer (byte table when byte-level, else windowed)."""
    table = token_bytes(tokenizer, vocab_size)
    if table is not None:
        return lambda: BytePieces(table)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} is not a fast (tokenizer.json) tokenizer")
    model = json.loads(tokenizer.backend_tokenizer.to_str()).get("model", {})
    byte_tokens = {index for token, index in tokenizer.get_vocab().items() if BYTE_TOKEN.match(token)} \
        if model.get("byte_fallback") else set()
    # A skipped special token is no boundary either: decode drops it first, so the bytes around it form one run.
    held = frozenset(byte_tokens | special_ids(tokenizer))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return lambda: WindowPieces(decode, held)

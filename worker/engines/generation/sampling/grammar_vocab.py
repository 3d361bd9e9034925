"""Byte-fallback tokenizers in Llama 2's shape, for llguidance and for decoding: two shapes both misread.

llguidance learns each token's bytes from the tokenizer's decoder. Llama 2 and Mistral ship a decoder chain
(Replace "▁" by " ", ByteFallback, Fuse, Strip) it recognises; a SentencePiece-style tokenizer trained with the
`tokenizers` library usually has a plain `Metaspace` decoder instead, which llguidance refuses ("can't determine
decoder type"), and lists its byte-fallback tokens `<0x00>`..`<0xFF>` as added special tokens, which llguidance then
treats as specials that match no text: every constrained request on such a model could only end at once (an empty
answer). Decoding with skip_special_tokens drops such byte tokens too (a `{` that exists only as `<0x7B>` vanishes
from the text). Both are rewritten here, to what those tokenizers mean: Metaspace's rule plus byte fallback, and the
byte tokens as the vocabulary entries they are; encoding is unchanged.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
SPIECE = "\u2581"


def _llama2_decoder(replacement: str) -> dict[str, Any]:
    return {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": replacement}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def _metaspace(decoder: Any) -> dict[str, Any] | None:
    """The Metaspace decoder in `decoder` (alone or in a Sequence), if any."""
    if not isinstance(decoder, dict):
        return None
    if decoder.get("type") == "Metaspace":
        return decoder
    if decoder.get("type") == "Sequence":
        return next((d for d in decoder.get("decoders", []) if isinstance(d, dict) and d.get("type") == "Metaspace"),
                    None)
    return None


def llama2_shape(tokenizer_json: str) -> str:
    """`tokenizer_json` with a Metaspace decoder made Llama 2's chain and byte tokens kept as plain vocabulary."""
    data = json.loads(tokenizer_json)
    metaspace = _metaspace(data.get("decoder"))
    if metaspace is not None:
        data["decoder"] = _llama2_decoder(str(metaspace.get("replacement") or SPIECE))
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        data["added_tokens"] = [t for t in data.get("added_tokens") or []
                                if not (BYTE_TOKEN.fullmatch(str(t.get("content"))) and t.get("content") in vocab)]
    return json.dumps(data)


def with_plain_byte_tokens(tokenizer: Any) -> Any:
    """A fast HF tokenizer whose backend is put in Llama 2's shape (llama2_shape) when it differs; the same object."""
    backend = tokenizer.backend_tokenizer
    text = backend.to_str()
    shaped = llama2_shape(text)
    if json.loads(shaped) != json.loads(text):
        tokenizer._tokenizer = Tokenizer.from_str(shaped)
    return tokenizer

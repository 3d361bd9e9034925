"""Structured output: grammars compiled once per constraint, one matcher per constrained sequence.

Library: llguidance, chosen over xgrammar after trying both (bench/grammar_libraries.py: torch 2.13 on the
CPU, our GPT-2 byte-level BPE and a Llama-2-style Metaspace/byte-fallback tokenizer, 30 uniformly random walks
through the masks of a schema with a short string, enums, bounded integers, maxItems, a nested object and
additionalProperties: false). Both run on the CPU with both tokenizers, but only llguidance 1.9.1 was always
right: 30/30 valid on each tokenizer, where xgrammar 0.2.9 gave 28/30 on GPT-2 and 19/30 on the byte-fallback
one (raw control characters inside strings: invalid JSON). llguidance also refuses schema keywords it cannot
enforce (uniqueItems) where xgrammar ignores them, so no output silently breaks its schema. Costs (load ~16
on 2 cores): compile ~50 ms vs ~120 ms (xgrammar) on GPT-2, ~50 ms vs ~45 ms on the small vocabulary; mask
median 0.4 ms vs 0.2 ms per row and step on GPT-2's vocabulary, small beside a decode step; llguidance's
tokenizer setup is slower (~10 s vs ~3.4 s for GPT-2 under that load), paid once per engine on the first
constrained request, on the submitting thread. Whitespace flexibility is off, so a bounded schema always
closes within a bounded number of tokens.
"""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import llguidance
import torch

from core.protocol import Constraint
from worker.engines.generation.sampling.grammar_vocab import llama2_shape

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compiled grammars kept per engine: a client repeating one schema pays its compile once.
CACHE_SIZE = 64
# The probe of a newly compiled grammar (probe()): a few short random walks, bounded in time.
PROBE_WALKS = 4
PROBE_STEPS = 12
PROBE_BUDGET_S = 0.5
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `field` names the request field it came from."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def field_of(constraint: Constraint) -> str:
    """The request field a constraint came from (for error envelopes)."""
    if constraint.field is not None:
        return constraint.field
    return {"choice": "guided_choice", "regex": "guided_regex", "lark": "tools"}.get(constraint.kind, "response_format")


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}", field_of(constraint)) from exc
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object", field_of(constraint))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if constraint.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(constraint.spec)
    choices = json.loads(constraint.spec)
    # Lark string literals take JSON's escapes, so each choice is matched exactly.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from a fast HF tokenizer (as llguidance.hf.from_tokenizer builds it, from the backend's
    JSON without padding or truncation), its decoder and byte tokens put in a shape it reads (grammar_vocab)."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(llama2_shape(backend.to_str()), n_vocab=vocab_size, eos_token=eos)


class Grammars:
    """An engine's grammar compiler: the llguidance tokenizer (built on first use) and an LRU of compiled grammars.

    `matcher` runs on the submitting thread, never the scheduler's: compiling stays off the decode loop.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int], size: int = CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._size = size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence; GrammarError when the constraint does not compile."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                return compiled.deep_copy()
            if self._tokenizer is None:
                self._tokenizer = _ll_tokenizer(self._hf_tokenizer, self._vocab_size, self._eos)
            tokenizer = self._tokenizer
        compiled = llguidance.LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
        error = compiled.get_error() if compiled.is_error() else probe(compiled, self._vocab_size, self._eos)
        if error:
            raise GrammarError(f"cannot enforce this {constraint.kind}: {_first_line(error)}", field_of(constraint))
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > self._size:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    @property
    def cached(self) -> int:
        """How many compiled grammars are cached."""
        with self._lock:
            return len(self._compiled)


def probe(compiled: llguidance.LLMatcher, vocab_size: int, eos: list[int], *, walks: int = PROBE_WALKS,
          steps: int = PROBE_STEPS, budget_s: float = PROBE_BUDGET_S) -> str | None:
    """The error a matcher of this grammar meets on a few short seeded random walks through its masks, else None.

    A grammar can compile and still fail once generation starts: an Earley row past llguidance's item limit (600
    optional properties fail on the first key), a lexer that cannot follow. Its matcher then allows only the end of
    sequence, which would read as an empty answer; walking it here, off the decode loop, turns that into a 4xx
    before generation. Each step takes a random allowed token other than eos, so the walk goes into the grammar.
    """
    rng = random.Random(0)
    started = time.monotonic()
    for _ in range(walks):
        matcher = compiled.deep_copy()
        for _ in range(steps):
            allowed = allowed_tokens([matcher], vocab_size)[0]
            if matcher.is_error():
                return str(matcher.get_error())
            allowed[eos] = False
            choices = allowed.nonzero()[:, 0]
            if not len(choices) or time.monotonic() - started > budget_s:
                break
            matcher.consume_token(int(choices[rng.randrange(len(choices))]))
            if matcher.is_error():
                return str(matcher.get_error())
        if time.monotonic() - started > budget_s:
            break
    return None


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "the matcher failed"


def allowed_tokens(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """Each matcher's allowed next tokens as a bool mask [R, vocab_size] (on the CPU)."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * words * 4, words * 4)
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # little-endian bits of each word
    return bits.reshape(len(matchers), words * 32)[:, :vocab_size].bool()

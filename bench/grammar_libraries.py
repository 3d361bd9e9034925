"""Compare the two grammar libraries for structured output: xgrammar against llguidance (the baseline we ship).

Per tokenizer (GPT-2 byte-level BPE; a Llama-2-style Metaspace/byte-fallback one trained from examples/data):
tokenizer setup and schema compile time, mask time per step, and how many of N uniformly random walks through
the masks give JSON that parses and validates. Needs `pip install xgrammar llguidance jsonschema` (xgrammar is
not a dependency of trainserve).  Run: PYTHONPATH=. python bench/grammar_libraries.py
"""

from __future__ import annotations

import json
import random
import time

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import xgrammar
from transformers import GPT2Tokenizer

from core.paths import GPT2_TOKENIZER_DIR
from tests.unit.test_engine_structured import SCHEMA, build_llama_tokenizer

WALKS = 30


def _walk(fill, accept, vocab: int, eos: int, seed: int) -> tuple[list[int], list[float]]:
    rng, out, times = random.Random(seed), [], []
    for _ in range(400):
        start = time.perf_counter()
        words = fill()
        times.append(time.perf_counter() - start)
        token = rng.choice([i for i in range(vocab) if (words[i // 32] >> (i % 32)) & 1])
        accept(token)
        if token == eos:
            break
        out.append(token)
    return out, times


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def xgrammar_walks(tokenizer, eos: int):
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    valid, times = 0, []
    for seed in range(WALKS):
        matcher, bitmask = xgrammar.GrammarMatcher(grammar), xgrammar.allocate_token_bitmask(1, len(tokenizer))

        def fill(m=matcher, b=bitmask):
            m.fill_next_token_bitmask(b)
            return b[0].tolist()

        ids, step_times = _walk(fill, matcher.accept_token, len(tokenizer), eos, seed)
        times += step_times
        valid += _valid(tokenizer.decode(ids))
    return setup, compile_s, times, valid


def llguidance_walks(tokenizer, eos: int):
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos)
    setup = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    start = time.perf_counter()
    compiled = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    valid, times = 0, []
    for seed in range(WALKS):
        matcher, bitmask = compiled.deep_copy(), llguidance.torch.allocate_token_bitmask(1, len(tokenizer))

        def fill(m=matcher, b=bitmask):
            llguidance.torch.fill_next_token_bitmask(m, b, 0)
            return b[0].tolist()

        ids, step_times = _walk(fill, matcher.consume_token, len(tokenizer), eos, seed)
        times += step_times
        valid += _valid(tokenizer.decode(ids))
    return setup, compile_s, times, valid


def main() -> None:
    llama = build_llama_tokenizer()
    for name, tokenizer, eos in (("gpt2", GPT2Tokenizer.from_pretrained(GPT2_TOKENIZER_DIR), 50256),
                                 ("llama-byte-fallback", llama, llama.eos_token_id)):
        for library, run in (("llguidance", llguidance_walks), ("xgrammar", xgrammar_walks)):
            setup, compile_s, times, valid = run(tokenizer, eos)
            times.sort()
            print(f"{name:20} {library:10} setup {setup * 1e3:7.0f} ms  compile {compile_s * 1e3:5.0f} ms  "
                  f"mask median {times[len(times) // 2] * 1e3:.3f} ms  "
                  f"p99 {times[int(len(times) * .99)] * 1e3:.2f} ms  "
                  f"valid {valid}/{WALKS}")


if __name__ == "__main__":
    main()

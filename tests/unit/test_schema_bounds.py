"""Schema-constrained output ends: open strings and numbers get bounds (core/schema_bounds.py) that the grammar both
engines compile enforces; a schema's own bounds win."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import GPT2TokenizerFast

from app.schemas.chat import ChatCompletionRequest
from app.services.structured import constraint_of
from core.paths import GPT2_TOKENIZER_DIR
from core.protocol import Constraint
from core.schema_bounds import bounded_schema
from core.settings import Settings
from worker.engines.generation.sampling.grammar import Grammars

SCHEMA = {"type": "object", "properties": {
    "population": {"type": "integer"}, "name": {"type": "string"}, "share": {"type": "number"},
    "code": {"type": "string", "maxLength": 3}, "big": {"type": "integer", "maximum": 10**18},
    "enum": {"type": ["string", "null"]}}, "required": ["population"], "additionalProperties": False}
BOUNDS = {"max_string_chars": 12, "max_number_digits": 16, "max_fraction_digits": 4}


def test_open_bounds_are_filled_and_the_schemas_own_win() -> None:
    bounded = bounded_schema(SCHEMA, **BOUNDS)
    props = bounded["properties"]
    assert props["population"] == {"type": "integer", "minimum": -(10**16 - 1), "maximum": 10**16 - 1}
    assert props["name"]["maxLength"] == 12 and props["code"]["maxLength"] == 3  # its own maxLength wins
    assert props["big"]["maximum"] == 10**18 and props["big"]["minimum"] == -(10**16 - 1)
    assert props["share"]["multipleOf"] == 1e-4 and props["enum"]["maxLength"] == 12  # a property named "enum"
    validate = jsonschema.Draft202012Validator(bounded).is_valid
    assert validate({"population": 10**15, "name": "Lyon", "share": 0.25, "big": 10**17})
    assert not validate({"population": int("1" * 40)}) and not validate({"population": 1, "name": "x" * 13})


@pytest.fixture(scope="module")
def grammars() -> tuple[Grammars, GPT2TokenizerFast]:
    tokenizer = GPT2TokenizerFast.from_pretrained(GPT2_TOKENIZER_DIR)
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


def _accepts(grammars: tuple[Grammars, GPT2TokenizerFast], constraint: Constraint, text: str) -> bool:
    compiled, tokenizer = grammars
    matcher, ids = compiled.matcher(constraint), tokenizer.encode(text)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


def test_the_request_schema_both_engines_get_refuses_endless_numbers_and_strings(grammars) -> None:
    settings = Settings(structured_max_string_chars=12, structured_max_fraction_digits=4)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    constraint = constraint_of(body, settings)
    assert constraint is not None and json.loads(constraint.spec)["properties"]["name"]["maxLength"] == 12
    # llguidance keeps the properties' order, alphabetical in the spec (sorted once per schema)
    assert _accepts(grammars, constraint, '{"name":"Lyon","population":1234567890123456,"share":0.25}')
    assert not _accepts(grammars, constraint, '{"population":' + "1" * 40 + "}")
    assert not _accepts(grammars, constraint, '{"name":"' + "x" * 13 + '","population":1}')
    assert not _accepts(grammars, constraint, '{"population":1,"share":0.' + "1" * 20 + "}")
    assert _accepts(grammars, constraint, '{"big":' + "9" * 18 + ',"code":"abc","population":1}')  # own bounds
    assert not _accepts(grammars, constraint, '{"code":"abcd","population":1}')

"""The OpenAPI document types the job request: one schema per job kind, every hyperparameter with its type,
bounds and default (a client generator gets a typed model, not a free-form object)."""

from __future__ import annotations

from dataclasses import fields

from annotated_types import Ge, Gt, Le, Lt

from core.jobspec import KINDS

BOUNDS = {Ge: "minimum", Gt: "exclusiveMinimum", Le: "maximum", Lt: "exclusiveMaximum"}


def _resolve(schema: dict, document: dict) -> dict:
    ref = schema.get("$ref")
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def _types(schema: dict) -> set[str]:
    options = schema.get("anyOf", [schema])
    return {option["type"] for option in options if "type" in option}


def test_post_jobs_body_is_one_schema_per_kind_with_typed_hyperparameters(client):
    document = client.get("/openapi.json").json()
    body = document["paths"]["/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    members = [_resolve(member, document) for member in body["oneOf"]]
    by_kind = {member["properties"]["task"].get("const") or member["properties"]["task"]["enum"][0]: member
               for member in members}
    assert set(by_kind) == set(KINDS)
    for name, kind in KINDS.items():
        hyperparameters = _resolve(by_kind[name]["properties"]["hyperparameters"], document)
        model = kind.hyperparameters
        assert set(hyperparameters["properties"]) == set(model.model_fields), name
        assert hyperparameters.get("additionalProperties") is False  # unknown keys are refused
        for field_name, field in model.model_fields.items():
            schema = hyperparameters["properties"][field_name]
            assert _types(schema) or "enum" in schema, (name, field_name, schema)
            assert schema.get("description"), (name, field_name)
            if field.default is not None:
                assert schema["default"] == field.default, (name, field_name)
            typed = next(o for o in schema.get("anyOf", [schema]) if o.get("type") != "null")
            for bound in field.metadata:
                key = BOUNDS.get(type(bound))
                if key is not None:
                    assert typed[key] == getattr(bound, fields(bound)[0].name), (name, field_name, key)


def test_learning_rate_reads_as_a_bounded_number_with_each_kinds_default(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    classifier, lm = schemas["Hyperparameters"]["properties"], schemas["LMHyperparameters"]["properties"]
    assert classifier["learning_rate"] == {**classifier["learning_rate"], "type": "number", "default": 5e-5,
                                           "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert lm["learning_rate"]["default"] == 3e-4 and lm["block_size"]["anyOf"][0]["type"] == "integer"
    assert classifier["precision"]["enum"] == ["auto", "fp16", "bf16", "fp32"]

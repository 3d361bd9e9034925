"""The wire protocol: payloads survive the broker's JSON, events parse back to their types, every code is named."""

from __future__ import annotations

import json

import pytest

import core.auth
import core.errors
from app.errors import from_wire, status_for
from core.embeddings import ClassifyResult, ClassifyTask
from core.protocol import (
    AcceptedEvent,
    DoneEvent,
    ErrorBody,
    ErrorCode,
    ErrorEvent,
    GenerateTask,
    SamplingParams,
    TokenEvent,
    error_body,
    parse_event,
)


def test_a_generate_task_survives_the_brokers_json() -> None:
    task = GenerateTask(request_id="gen-1", model="/m", prompt="hi", deadline=12.5,
                        params=SamplingParams(max_new_tokens=4, temperature=0, stop=["\n"], seed=3, n=2))
    back = GenerateTask.model_validate(json.loads(json.dumps(task.model_dump(mode="json"))))
    assert back == task and back.params.stop == ("\n",) and back.params.greedy


def test_events_parse_back_to_their_types() -> None:
    events = [TokenEvent(index=0, text="a"), AcceptedEvent(prompt_tokens=3),
              DoneEvent.model_validate({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                                        "usage": {"prompt_tokens": 3, "completion_tokens": 1}}),
              ErrorEvent.of(ErrorCode.OVERLOADED, "busy")]
    assert [parse_event(e.model_dump_json()) for e in events] == events
    with pytest.raises(ValueError):
        parse_event(json.dumps({"type": "nonsense"}))


def test_classify_messages_round_trip() -> None:
    task = ClassifyTask(request_id="cls-1", job_id="job_1", texts=["x"], deadline=1.0)
    assert ClassifyTask.model_validate_json(task.model_dump_json()) == task
    sent = ClassifyResult(predictions=[{"label": 1, "score": 0.9}])
    result = ClassifyResult.model_validate_json(sent.model_dump_json())
    assert result.predictions is not None and result.predictions[0].label == 1 and result.error is None


def test_every_domain_error_code_is_an_error_code() -> None:
    classes = [c for module in (core.errors, core.auth) for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, core.errors.DomainError)]
    assert len(classes) >= 10
    assert {c.code for c in classes} <= set(ErrorCode)


def test_one_error_body_and_one_mapping_from_the_wire() -> None:
    assert error_body(ErrorCode.VALIDATION_ERROR, "bad", "x") == {
        "error": {"code": "validation_error", "message": "bad", "field": "x"}}
    assert core.errors.NotFound("gone", field="id").envelope() == error_body("not_found", "gone", "id")
    cases = {"validation_error": 422, "queue_timeout": 503, "overloaded": 429, "worker_timeout": 504,
             "broker_unavailable": 503, "worker_error": 502, "something_new": 502}
    for code, status in cases.items():
        error = from_wire(ErrorBody(code=code, message="m", field="f" if code == "validation_error" else None))
        assert (status_for(error), error.code) == (status, code)


def test_codes_spelled_in_the_source_are_error_codes() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sources = {path: path.read_text() for folder in ("app", "core", "worker") for path in (root / folder).rglob("*.py")}
    # Codes are ErrorCode members wherever they are named: no string literal outside core/protocol.py.
    spelled = {m for text in sources.values()
               for m in re.findall(r'(?:\bcode=|_send_error\(send, \d+, )"([a-z_]+)"', text)}
    assert not spelled, spelled
    named = {m for text in sources.values() for m in re.findall(r"\bErrorCode\.([A-Z_]+)\b", text)}
    assert named and named <= {member.name for member in ErrorCode}, named


def test_rank_messages_are_one_typed_union_keyed_by_kind():
    from pydantic import ValidationError

    from core.protocol import RANK_MESSAGE, RankBest, RankError, RankEvent, RankResult, RankShouldStop

    sent = [RankShouldStop(), RankEvent(event="oom", message="halved"), RankBest(step=4, best={"metric": "eval_f1"}),
            RankResult(status="completed", step=8, total_steps=8, stop_reason="early_stopping"),
            RankError(code="oom", message="OutOfMemory: 2 GiB")]
    received = [RANK_MESSAGE.validate_json(RANK_MESSAGE.dump_json(message)) for message in sent]
    assert received == sent and [type(m) for m in received] == [type(m) for m in sent]
    assert RankError(message="x").code == "training_error"
    with pytest.raises(ValidationError):  # each kind carries its own fields: a best needs its evaluation
        RANK_MESSAGE.validate_python({"kind": "best", "step": 4})
    with pytest.raises(ValidationError):
        RANK_MESSAGE.validate_python({"kind": "event", "event": "oom", "message": "m", "name": "old shape"})

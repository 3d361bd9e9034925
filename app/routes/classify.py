"""Prediction route."""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import PrincipalDep, QueueDep, SessionDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.schemas.classify import ClassifyRequest, ClassifyResponse, Prediction
from app.services import classify as service

router = APIRouter(tags=["inference"], responses=ERROR_RESPONSES)


@router.post("/classify", response_model=ClassifyResponse)
def classify(body: ClassifyRequest, session: SessionDep, settings: SettingsDep, queue: QueueDep,
             principal: PrincipalDep) -> ClassifyResponse:
    """Classify texts with a fine-tuned model (the id of its succeeded job)."""
    predictions = service.classify(session, settings, queue, principal, model=body.model, texts=body.texts)
    return ClassifyResponse(model=body.model, predictions=[Prediction(**p) for p in predictions])

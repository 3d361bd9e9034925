"""Prediction route."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.deps import PrincipalDep, QueueDep, SessionDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.schemas.classify import ClassifyRequest, ClassifyResponse, Prediction
from app.services import classify as service

router = APIRouter(tags=["inference"], responses=ERROR_RESPONSES)


@router.post("/classify", response_model=ClassifyResponse)
async def classify(body: ClassifyRequest, request: Request, session: SessionDep, settings: SettingsDep,
                   queue: QueueDep, principal: PrincipalDep) -> ClassifyResponse:
    """Classify texts with a fine-tuned model (the id of its succeeded job); waits without holding a thread."""
    predictions = await service.classify(session, settings, queue, request.app.state.redis, principal,
                                         model=body.model, texts=body.texts, disconnected=request.is_disconnected)
    return ClassifyResponse(model=body.model, predictions=[Prediction(**p.model_dump()) for p in predictions])

"""OpenAI's /v1/fine_tuning/alpha/graders: run one grader on one sample, validate a grader."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.deps import PrincipalDep, SessionDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.routes.generation import GatewayDep
from app.schemas.graders import GraderRunRequest, GraderRunResponse, GraderValidateRequest, GraderValidateResponse
from app.services import graders as service

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["openai"], responses=ERROR_RESPONSES)


@router.post("/run", response_model=GraderRunResponse)
async def run_grader(body: GraderRunRequest, request: Request, session: SessionDep, principal: PrincipalDep,
                     gateway: GatewayDep) -> GraderRunResponse:
    """Grade `model_sample` (with `item`); model graders call the served models named, as the caller."""
    models = service.ServedModels(gateway, session, principal, request.is_disconnected)
    return await service.run_grader(models, body)


@router.post("/validate", response_model=GraderValidateResponse)
def validate_grader(body: GraderValidateRequest, principal: PrincipalDep, settings: SettingsDep
                    ) -> GraderValidateResponse:
    """The grader as it will run (a grader that does not validate is a 422 naming its field)."""
    return service.validate_grader(body, settings)

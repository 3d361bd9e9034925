"""OpenAI's Responses API: /v1/responses (create, streamed or not), retrieve, delete, cancel and input items."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from app.deps import PrincipalDep, SessionDep
from app.errors import ERROR_RESPONSES
from app.routes.generation import STREAM_DOC, GatewayDep, respond
from app.schemas.responses import InputItemList, Response, ResponseCreate, ResponseDeleted
from app.services import responses as service

router = APIRouter(tags=["generation"], responses=ERROR_RESPONSES)


@router.post("/v1/responses", response_model=Response, responses=STREAM_DOC)
async def create_response(body: ResponseCreate, request: Request, session: SessionDep, principal: PrincipalDep,
                          gateway: GatewayDep) -> Any:
    """OpenAI's Responses API on the chat path: items, function tools, text.format, reasoning items, and (store,
    the default) previous_response_id; `stream: true` sends its typed events."""
    return respond(await service.create_response(gateway, session, request.app.state.sessionmaker, principal, body,
                                                 request.is_disconnected))


@router.get("/v1/responses/{response_id}", response_model=Response)
def get_response(response_id: str, session: SessionDep, principal: PrincipalDep) -> Response:
    """A stored response of this tenant (until TRAINSERVE_RESPONSES_RETENTION_S after it was made)."""
    return service.get_response(session, principal, response_id)


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
def delete_response(response_id: str, session: SessionDep, principal: PrincipalDep) -> ResponseDeleted:
    """Delete a stored response; it can no longer be retrieved or named as previous_response_id."""
    return service.remove_response(session, principal, response_id)


@router.post("/v1/responses/{response_id}/cancel", response_model=Response)
def cancel_response(response_id: str, session: SessionDep, principal: PrincipalDep) -> Response:
    """Cancel a background response: none is ever made here (background is refused), so a stored one is a 409."""
    return service.cancel_response(session, principal, response_id)


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList)
def list_input_items(response_id: str, session: SessionDep, principal: PrincipalDep,
                     after: Annotated[str | None, Query(max_length=100, description="The last id of the page "
                                                        "before.")] = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
                     include: Annotated[list[str] | None, Query()] = None) -> InputItemList:
    """A stored response's own input items, newest first unless order=asc."""
    return service.list_input_items(session, principal, response_id, after=after, limit=limit, order=order,
                                    include=include or [])

"""Model aliases: `family:stage` names every generation route serves, moved atomically (optionally gated by an
eval) with their history and lineage."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Response

from app.deps import PrincipalDep, SessionDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.schemas.aliases import AliasCreate, AliasHistory, AliasList, AliasMove, AliasRead
from app.services import aliases as service

router = APIRouter(prefix="/aliases", tags=["aliases"], responses=ERROR_RESPONSES)


@router.post("", response_model=AliasRead, status_code=201)
def create_alias(body: Annotated[AliasCreate, Body()], session: SessionDep, settings: SettingsDep,
                 principal: PrincipalDep) -> AliasRead:
    """Name a servable model (a local model, a job, an adapter job, a hub id)."""
    return service.alias_read(session, service.create_alias(session, settings, principal, body=body))


@router.get("", response_model=AliasList)
def list_aliases(session: SessionDep, principal: PrincipalDep) -> AliasList:
    """The caller's aliases with their targets and lineage."""
    return service.list_all(session, principal)


@router.get("/{name}", response_model=AliasRead)
def retrieve_alias(name: str, session: SessionDep, principal: PrincipalDep) -> AliasRead:
    """The alias, its target, and the target's lineage (base model, dataset, job, checkpoints)."""
    return service.alias_read(session, service.get_alias(session, principal, name=name))


@router.post("/{name}/move", response_model=AliasRead)
def move_alias(name: str, body: Annotated[AliasMove, Body()], session: SessionDep, settings: SettingsDep,
               principal: PrincipalDep) -> AliasRead:
    """Point the alias at another model: atomic, recorded, sent as a model_alias.moved webhook; 409 when its gate
    refuses (the new target's run must beat the current target's on the gate's eval)."""
    return service.alias_read(session, service.move_alias(session, settings, principal, name=name, body=body))


@router.get("/{name}/history", response_model=AliasHistory)
def alias_history(name: str, session: SessionDep, principal: PrincipalDep) -> AliasHistory:
    """Every move, newest first: who, when, from, to, and the gate's verdict."""
    return service.history(session, principal, name=name)


@router.delete("/{name}", status_code=204)
def delete_alias(name: str, session: SessionDep, principal: PrincipalDep) -> Response:
    service.delete_alias(session, principal, name=name)
    return Response(status_code=204)

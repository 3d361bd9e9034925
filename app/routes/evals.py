"""OpenAI's /v1/evals: evals, their runs and the runs' output items (the official client's `evals` resource)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query
from starlette.concurrency import run_in_threadpool

from app.deps import PrincipalDep, QueueDep, SessionDep, SettingsDep, StorageDep
from app.errors import ERROR_RESPONSES
from app.schemas.evals import (
    EvalCreate,
    EvalDeleted,
    EvalList,
    EvalObject,
    EvalRunList,
    EvalRunObject,
    EvalUpdate,
    OutputItemList,
    OutputItemObject,
    RunCreate,
)
from app.services import evals as service

router = APIRouter(prefix="/v1/evals", tags=["openai"], responses=ERROR_RESPONSES)
After = Annotated[str | None, Query(max_length=40, description="The last id of the previous page.")]
Limit = Annotated[int, Query(ge=1, le=100)]
RunStatus = Literal["queued", "in_progress", "completed", "canceled", "failed"]


@router.post("", response_model=EvalObject, response_model_by_alias=True)
def create_eval(body: Annotated[EvalCreate, Body()], session: SessionDep, settings: SettingsDep,
                principal: PrincipalDep) -> EvalObject:
    """An item schema and the testing criteria (graders) every run is graded by."""
    return service.eval_object(service.create_eval(session, settings, principal, body=body))


@router.get("", response_model=EvalList)
def list_evals(session: SessionDep, principal: PrincipalDep, after: After = None, limit: Limit = 20) -> EvalList:
    """The caller's evals, newest first."""
    return service.list_page(session, principal, after=after, limit=limit)


@router.get("/{eval_id}", response_model=EvalObject)
def retrieve_eval(eval_id: str, session: SessionDep, principal: PrincipalDep) -> EvalObject:
    return service.eval_object(service.get_eval(session, principal, eval_id=eval_id))


@router.post("/{eval_id}", response_model=EvalObject)
def update_eval(eval_id: str, body: Annotated[EvalUpdate, Body()], session: SessionDep, principal: PrincipalDep
                ) -> EvalObject:
    """Rename, or replace the metadata."""
    return service.eval_object(service.update_eval(session, principal, eval_id=eval_id, body=body))


@router.delete("/{eval_id}", response_model=EvalDeleted)
def delete_eval(eval_id: str, session: SessionDep, principal: PrincipalDep) -> EvalDeleted:
    """Delete an eval and its runs (409 while a run is in progress)."""
    service.delete_eval(session, principal, eval_id=eval_id)
    return EvalDeleted(eval_id=eval_id)


@router.post("/{eval_id}/runs", response_model=EvalRunObject)
async def create_run(eval_id: str, body: Annotated[RunCreate, Body()], session: SessionDep, settings: SettingsDep,
                     storage: StorageDep, queue: QueueDep, principal: PrincipalDep) -> EvalRunObject:
    """Run the eval against a served model: its items' answers are generated as a batch and graded."""
    run = await run_in_threadpool(service.create_run, session, settings, storage, queue, principal, eval_id=eval_id,
                                  body=body)
    return service.run_object(session, run)


@router.get("/{eval_id}/runs", response_model=EvalRunList)
def list_runs(eval_id: str, session: SessionDep, principal: PrincipalDep, after: After = None, limit: Limit = 20,
              status: RunStatus | None = None) -> EvalRunList:
    return service.list_runs(session, principal, eval_id=eval_id, after=after, limit=limit, status=status)


@router.get("/{eval_id}/runs/{run_id}", response_model=EvalRunObject)
def retrieve_run(eval_id: str, run_id: str, session: SessionDep, principal: PrincipalDep) -> EvalRunObject:
    """Status, result_counts, per_testing_criteria_results and the samples' token usage."""
    return service.run_object(session, service.get_run(session, principal, eval_id=eval_id, run_id=run_id))


@router.post("/{eval_id}/runs/{run_id}", response_model=EvalRunObject)
def cancel_run(eval_id: str, run_id: str, session: SessionDep, principal: PrincipalDep) -> EvalRunObject:
    """Cancel a run (OpenAI's POST on the run): graded items are kept."""
    return service.run_object(session, service.cancel_run(session, principal, eval_id=eval_id, run_id=run_id))


@router.get("/{eval_id}/runs/{run_id}/output_items", response_model=OutputItemList)
def list_output_items(eval_id: str, run_id: str, session: SessionDep, storage: StorageDep, principal: PrincipalDep,
                      after: After = None, limit: Limit = 20, status: Literal["pass", "fail", "error"] | None = None,
                      order: Literal["asc", "desc"] = "asc") -> OutputItemList:
    """Each graded item: its data, the model's sample and every criterion's result."""
    return service.list_output_items(session, storage, principal, eval_id=eval_id, run_id=run_id, after=after,
                                     limit=limit, status=status, order=order)


@router.get("/{eval_id}/runs/{run_id}/output_items/{item_id}", response_model=OutputItemObject)
def retrieve_output_item(eval_id: str, run_id: str, item_id: str, session: SessionDep, storage: StorageDep,
                         principal: PrincipalDep) -> OutputItemObject:
    return service.get_output_item(session, storage, principal, eval_id=eval_id, run_id=run_id, item_id=item_id)

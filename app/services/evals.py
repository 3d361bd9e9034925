"""/v1/evals: evals (item schema + testing criteria), runs against a served model, and their graded output items.

A run renders each item's messages, stores the items and the rendered requests (a purpose "batch" file), and
creates a /v1/batches batch naming the run in the same commit; the generation workers run and grade it
(worker.batches.grading), counting each item into the run's row as it is stored; the status is read from those counts
and the batch (core.evals.run_status).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.schemas.evals import (
    CriterionResult,
    DataSourceConfigRead,
    EvalCreate,
    EvalList,
    EvalObject,
    EvalRunList,
    EvalRunObject,
    EvalUpdate,
    ModelUsage,
    OutputItemList,
    OutputItemObject,
    ResultCounts,
    RunCreate,
)
from app.schemas.fine_tuning import JobEval
from app.services import batches, files
from app.services.files import unix
from app.services.generation import check_prompt_bytes
from core.auth import Principal
from core.batches import send_batch
from core.errors import Conflict, NotFound, StorageUnavailable, ValidationFailed
from core.eval_runs import RunItems, items_at, run_sampling, start_run, store_items
from core.evals import (
    CANCELED,
    IN_PROGRESS,
    MAX_ITEMS,
    QUEUED,
    CompletionsDataSource,
    CustomDataSourceConfig,
    FileContentSource,
    FileIdSource,
    input_messages,
    items_key,
    run_status,
)
from core.graders import Grader
from core.graders.models import calls_refusal, judge_refusal
from core.queue import TaskQueue
from core.rows import Batch, Eval, EvalOutputItem, EvalRun, Job, JobStatus, TaskKind, new_id, utcnow
from core.served_models import ServedModel, resolve_served_model
from core.settings import Settings
from core.storage import ArtifactStore
from core.store import evals as store
from core.store.paging import cursor_of


def eval_object(row: Eval) -> EvalObject:
    """An eval row as OpenAI's eval object."""
    config = CustomDataSourceConfig.model_validate(row.data_source_config)
    return EvalObject(id=row.id, name=row.name, created_at=unix(row.created_at) or 0,
                      data_source_config=DataSourceConfigRead(schema_=config.schema_object()),
                      testing_criteria=row.testing_criteria, metadata=row.metadata_)


def check_criteria_calls(settings: Settings, criteria: list[Grader]) -> None:
    """Testing criteria whose judges answer within the server's token cap and which call served models at most
    Settings.max_grader_model_calls times per item (422s name the criterion's field)."""
    fields = [(f"testing_criteria.{at}", criterion) for at, criterion in enumerate(criteria)]
    for where, criterion in fields:
        if (refusal := judge_refusal(criterion, settings.max_new_tokens, where)) is not None:
            raise ValidationFailed(*refusal)
    if (refusal := calls_refusal(fields, settings.max_grader_model_calls)) is not None:
        raise ValidationFailed(*refusal)


def create_eval(session: Session, settings: Settings, principal: Principal, *, body: EvalCreate) -> Eval:
    """Store an eval (its graders validated by the schema, their judges within the server's token cap)."""
    check_criteria_calls(settings, body.testing_criteria)
    row = Eval(id=new_id("eval"), tenant_id=principal.tenant_id, name=body.name or "eval",
               data_source_config=body.data_source_config.model_dump(mode="json"),
               testing_criteria=[c.model_dump(mode="json", by_alias=True, exclude_none=True)
                                 for c in body.testing_criteria],
               metadata_=body.metadata, created_at=utcnow())
    session.add(row)
    session.commit()
    return row


def get_eval(session: Session, principal: Principal, *, eval_id: str) -> Eval:
    return store.get_eval(session, eval_id=eval_id, tenant=principal.scope)


def list_page(session: Session, principal: Principal, *, after: str | None, limit: int) -> EvalList:
    cursor = cursor_of(get_eval(session, principal, eval_id=after)) if after else None
    rows = store.list_evals(session, tenant=principal.scope, limit=limit + 1, after=cursor)
    return EvalList.of([eval_object(row) for row in rows[:limit]], has_more=len(rows) > limit)


def update_eval(session: Session, principal: Principal, *, eval_id: str, body: EvalUpdate) -> Eval:
    row = get_eval(session, principal, eval_id=eval_id)
    if body.name is not None:
        row.name = body.name
    if body.metadata is not None:
        row.metadata_ = body.metadata
    session.commit()
    return row


def delete_eval(session: Session, principal: Principal, *, eval_id: str) -> None:
    """Delete an eval and its runs; 409 while one of them is running."""
    row = get_eval(session, principal, eval_id=eval_id)
    for run in session.scalars(select(EvalRun).where(EvalRun.eval_id == row.id)):
        if _status(session, run) in (QUEUED, IN_PROGRESS):
            raise Conflict(f"eval {eval_id!r} has a run in progress ({run.id}); cancel it first")
    session.delete(row)
    session.commit()


def _run_items(session: Session, principal: Principal, source: Any) -> RunItems:
    if isinstance(source, FileContentSource):
        return RunItems(inline=list(source.content))
    dataset = files.get_file(session, principal, file_id=source.id, field="data_source.source.id")
    if dataset.purpose != "evals":
        raise ValidationFailed("data_source.source.id", f"file {dataset.id!r} has purpose "
                                                        f"{dataset.purpose or 'fine-tune'}; an eval reads a file "
                                                        'uploaded with purpose "evals"')
    return RunItems(key=dataset.path)


def _check_items(settings: Settings, storage: ArtifactStore, items: RunItems, *, schema: dict[str, Any],
                 source: CompletionsDataSource, model: ServedModel) -> int:
    """Check each item as it is read (never all at once): the count, the item schema, its messages, and its size
    and its messages' by chat's byte check (check_prompt_bytes); the number of items."""
    validator = Draft202012Validator(schema)
    count = 0
    try:
        for at, entry in enumerate(items.read(storage)):
            if at >= MAX_ITEMS:
                raise ValidationFailed("data_source.source", f"at most {MAX_ITEMS} items per run")
            field = f"data_source.source.content.{at}.item" if items.inline is not None else "data_source.source.id"
            where = "" if items.inline is not None else f"item {at} of the file: "
            error = next(iter(validator.iter_errors(entry.item)), None)
            if error is not None:
                raise ValidationFailed(field, f"{where}item {at} does not match the eval's item_schema: "
                                              f"{error.message}")
            messages = _messages(source, entry.item, at)
            try:
                check_prompt_bytes(model, len(entry.model_dump_json().encode()), field, settings)
                check_prompt_bytes(model, sum(len(m["content"].encode()) for m in messages), field, settings)
            except ValidationFailed as exc:
                exc.message = where + exc.message
                raise
            count += 1
    except OSError as exc:
        raise StorageUnavailable(f"the artifact store could not be read: {type(exc).__name__}") from exc
    except ValidationError as exc:  # a kept evals file was checked on upload; one that no longer parses
        raise ValidationFailed("data_source.source.id", f"the file's items do not parse: {exc.errors()[0]['msg']}"
                               ) from exc
    return count


def _messages(source: CompletionsDataSource, item: dict[str, Any], at: int) -> list[dict[str, str]]:
    try:
        return input_messages(source, item)
    except ValueError as exc:
        raise ValidationFailed("data_source.input_messages", f"item {at}: {exc}") from exc


def prepare_run(session: Session, settings: Settings, storage: ArtifactStore, principal: Principal, *,
                eval_row: Eval, source: CompletionsDataSource, name: str | None,
                metadata: dict[str, str] | None) -> tuple[EvalRun, RunItems, str | None]:
    """Check the model, the items and their messages; an unsaved queued run, its items and their file id."""
    try:
        model = resolve_served_model(session, settings, name=source.model, tenant=principal.scope)
        run_sampling(source, settings)
    except (NotFound, ValidationFailed) as exc:
        exc.field = "data_source.model" if exc.field == "model" else exc.field
        raise
    items = _run_items(session, principal, source.source)
    total = _check_items(settings, storage, items, source=source, model=model,
                         schema=CustomDataSourceConfig.model_validate(eval_row.data_source_config).item_schema)
    file_id = source.source.id if isinstance(source.source, FileIdSource) else None
    run = EvalRun(id=new_id("evalrun"), eval_id=eval_row.id, tenant_id=principal.tenant_id,
                  name=name or source.model, model=source.model,
                  data_source=source.model_dump(mode="json", exclude_none=True), total=total, status=QUEUED,
                  metadata_=metadata, created_at=utcnow())
    return run, items, file_id


def create_run(session: Session, settings: Settings, storage: ArtifactStore, queue: TaskQueue, principal: Principal,
               *, eval_id: str, body: RunCreate) -> EvalRun:
    """Check the items and the model, store them with the run's batch (one commit), then send the batch's task."""
    row = get_eval(session, principal, eval_id=eval_id)
    run, items, file_id = prepare_run(session, settings, storage, principal, eval_row=row, source=body.data_source,
                                      name=body.name, metadata=body.metadata)
    session.add(run)
    try:
        batch = start_run(session, settings, storage, run=run, items=items, file_id=file_id)
    except OSError as exc:
        raise StorageUnavailable(f"the artifact store could not be written: {type(exc).__name__}") from exc
    session.commit()
    send_batch(session, queue, batch.id)
    session.refresh(run)
    return run


@dataclass
class JobRuns:
    """A fine-tuning job's eval, checked before the job is created: the base run (unsaved) and its items."""

    base: EvalRun
    items: RunItems
    file_id: str | None


def job_runs(session: Session, settings: Settings, storage: ArtifactStore, principal: Principal, *,
             job: JobEval | None, base_model: str, task: str) -> JobRuns | None:
    """Check a job's eval (422s name `eval.*`): the eval, its data source with the base model, the items."""
    if job is None:
        return None
    if task != TaskKind.CAUSAL_LM:
        raise ValidationFailed("eval", "an eval runs on chat models: causal-lm jobs only")
    try:
        eval_row = get_eval(session, principal, eval_id=job.eval_id)
        source = CompletionsDataSource.model_validate({"type": "completions", **job.data_source,
                                                       "model": base_model})
        base, items, file_id = prepare_run(session, settings, storage, principal, eval_row=eval_row, source=source,
                                           name="base", metadata=None)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(["eval.data_source", *(str(part) for part in first["loc"])])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ValidationFailed(field, f"{field}: {message}") from exc
    except (NotFound, ValidationFailed) as exc:
        exc.field = "eval.eval_id" if exc.field is None else f"eval.{exc.field}"
        raise
    return JobRuns(base=base, items=items, file_id=file_id)


def start_job_runs(session: Session, settings: Settings, storage: ArtifactStore, queue: TaskQueue, *, job_id: str,
                   runs: JobRuns) -> None:
    """Start the base run now and keep the fine-tuned run queued (a training worker starts it when the job
    succeeds: worker.batches.grading); nothing for a replayed request whose job has its runs already."""
    if session.scalar(select(EvalRun.id).where(EvalRun.job_id == job_id).limit(1)) is not None:
        return
    base = runs.base
    base.job_id, base.role = job_id, "base"
    session.add(base)
    try:
        batch = start_run(session, settings, storage, run=base, items=runs.items, file_id=runs.file_id)
        after = EvalRun(id=new_id("evalrun"), eval_id=base.eval_id, tenant_id=base.tenant_id, name="fine-tuned",
                        model=job_id, data_source={**base.data_source, "model": job_id}, total=base.total,
                        status=QUEUED, job_id=job_id, role="fine_tuned", created_at=utcnow())
        store_items(storage, after.id, RunItems(key=items_key(base.id)))
    except OSError as exc:
        raise StorageUnavailable(f"the artifact store could not be written: {type(exc).__name__}") from exc
    session.add(after)
    session.commit()
    send_batch(session, queue, batch.id)


def _batch_status(session: Session, run: EvalRun) -> str | None:
    if run.batch_id is None:
        return None
    return session.scalar(select(Batch.status).where(Batch.id == run.batch_id))


def _status(session: Session, run: EvalRun) -> str:
    if run.batch_id is None and run.job_id is not None:  # waits for its job: canceled if the job will not succeed
        job_status = session.scalar(select(Job.status).where(Job.id == run.job_id))
        if job_status in (JobStatus.FAILED, JobStatus.CANCELLED):
            return CANCELED
    return run_status(run.status, _batch_status(session, run), run.passed + run.failed + run.errored, run.total)


def run_object(session: Session, run: EvalRun) -> EvalRunObject:
    """A run row as OpenAI's eval.run, its counts as kept on its row (core.store.evals.count_items)."""
    by_status, by_criterion, usage = store.summary(run)
    criteria = [c["name"] for c in session.scalar(select(Eval.testing_criteria).where(Eval.id == run.eval_id)) or []]
    return EvalRunObject(
        id=run.id, eval_id=run.eval_id, name=run.name, model=run.model, status=_status(session, run),
        created_at=unix(run.created_at) or 0, data_source=run.data_source, batch_id=run.batch_id,
        job_id=run.job_id, role=run.role,  # type: ignore[arg-type]
        result_counts=ResultCounts(total=run.total, passed=by_status["pass"], failed=by_status["fail"],
                                   errored=by_status["error"]),
        per_testing_criteria_results=[CriterionResult(testing_criteria=name, passed=counts["passed"],
                                                      failed=counts["failed"])
                                      for name in criteria for counts in [by_criterion.get(name, Counter())]],
        per_model_usage=[ModelUsage(model_name=model, **counts) for model, counts in usage.items()],
        report_url=f"/v1/evals/{run.eval_id}/runs/{run.id}", error=run.error, metadata=run.metadata_)


def get_run(session: Session, principal: Principal, *, eval_id: str, run_id: str) -> EvalRun:
    get_eval(session, principal, eval_id=eval_id)
    return store.get_run(session, eval_id=eval_id, run_id=run_id, tenant=principal.scope)


def list_runs(session: Session, principal: Principal, *, eval_id: str, after: str | None, limit: int,
              status: str | None) -> EvalRunList:
    """An eval's runs, newest first (a status filter reads each run's status)."""
    get_eval(session, principal, eval_id=eval_id)
    cursor = cursor_of(get_run(session, principal, eval_id=eval_id, run_id=after)) if after else None
    rows = store.list_runs(session, eval_id=eval_id, limit=limit + 1, after=cursor)
    objects = [run_object(session, row) for row in rows]
    if status is not None:
        objects = [o for o in objects if o.status == status]
    return EvalRunList.of(objects[:limit], has_more=len(objects) > limit)


def cancel_run(session: Session, principal: Principal, *, eval_id: str, run_id: str) -> EvalRun:
    """Cancel a run: its batch stops after the chunk in progress; items graded so far are kept."""
    run = get_run(session, principal, eval_id=eval_id, run_id=run_id)
    if run.batch_id is None:
        raise Conflict(f"eval run {run_id!r} has not started; nothing to cancel")
    batches.cancel(session, principal, batch_id=run.batch_id)
    return run


def output_item_object(item: EvalOutputItem, datasource_item: dict[str, Any]) -> OutputItemObject:
    return OutputItemObject(id=item.id, run_id=item.run_id, eval_id=item.eval_id,
                            created_at=unix(item.created_at) or 0, status=item.status,
                            datasource_item_id=item.datasource_item_id, datasource_item=datasource_item,
                            results=item.results, sample=item.sample)


def _items(storage: ArtifactStore, run_id: str, indexes: list[int]) -> dict[int, dict[str, Any]]:
    try:
        return items_at(storage, run_id, indexes)
    except OSError as exc:
        raise StorageUnavailable(f"the artifact store could not be read: {type(exc).__name__}") from exc


def list_output_items(session: Session, storage: ArtifactStore, principal: Principal, *, eval_id: str, run_id: str,
                      after: str | None, limit: int, status: str | None, order: str) -> OutputItemList:
    """A run's graded items in item order (`order` asc) or reversed."""
    run = get_run(session, principal, eval_id=eval_id, run_id=run_id)
    after_index = None
    if after:
        previous = session.get(EvalOutputItem, after)
        if previous is None or previous.run_id != run.id:
            raise NotFound(f"output item {after!r} not found", field="after")
        after_index = previous.datasource_item_id
    rows = store.list_output_items(session, run_id=run.id, limit=limit + 1, after=after_index, status=status,
                                   ascending=order == "asc")
    items = _items(storage, run.id, [row.datasource_item_id for row in rows[:limit]])
    return OutputItemList.of([output_item_object(row, items[row.datasource_item_id]) for row in rows[:limit]],
                             has_more=len(rows) > limit)


def get_output_item(session: Session, storage: ArtifactStore, principal: Principal, *, eval_id: str, run_id: str,
                    item_id: str) -> OutputItemObject:
    run = get_run(session, principal, eval_id=eval_id, run_id=run_id)
    item = session.get(EvalOutputItem, item_id)
    if item is None or item.run_id != run.id:
        raise NotFound(f"output item {item_id!r} not found")
    return output_item_object(item, _items(storage, run.id, [item.datasource_item_id])[item.datasource_item_id])

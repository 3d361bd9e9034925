"""Grading an eval run on the generation worker that runs its batch, as each part of samples is stored.

worker.batches.run calls `grade_results` with the results of the lines it has stored (on a resume, first with the
results stored before the worker died). Items with grades are skipped (the (run, item) pair is unique), so a
redelivered batch never grades an item twice. Model graders call the served models in this worker through the
batch's line handlers and pacer: a judge's requests share the batch's fair share of the engines.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.batches import LineResult, PlannedLine, send_batch
from core.db import session_scope
from core.embeddings import resolve_embedding_model
from core.errors import BrokerUnavailable, DomainError
from core.eval_runs import RunItems, items_at, start_run
from core.evals import RUN_FAILED, CompletionsDataSource, FileIdSource, input_messages, items_key
from core.generation_limits import JUDGE
from core.graders import GRADER, AnyGrader, Grade, JudgeReply, ModelCallFailed, grade, sample_namespace
from core.graders.models import DEFAULT_EMBEDDING_MODEL, judge_tokens
from core.graders.spec import JudgeSampling
from core.pretrained import builtin_aliases
from core.protocol import ChatMessage, Constraint, SamplingParams
from core.rows import Eval, EvalOutputItem, EvalRun, EventKind, new_id, utcnow
from core.served_models import resolve_served_model
from core.store.evals import count_items, graded_count, graded_ids, summary
from core.store.jobs import add_event
from worker.batches.lines import LINE_HANDLERS, Pacer
from worker.context import WorkerContext

log = logging.getLogger(__name__)
CHAT, EMBEDDINGS = "/v1/chat/completions", "/v1/embeddings"


class WorkerModels:
    """core.graders.Models over this worker's engines, resolving names as the run's tenant."""

    def __init__(self, ctx: WorkerContext, tenant: str, batch_id: str, pacer: Pacer) -> None:
        self.ctx, self.tenant, self.batch_id, self.pacer = ctx, tenant, batch_id, pacer
        self._calls = itertools.count()

    def _run(self, line: PlannedLine) -> dict[str, Any]:
        index = next(self._calls)
        outcome = LINE_HANDLERS[line.url](self.ctx, f"{self.batch_id}-grader", [(index, line)], self.pacer)[index]
        if outcome.status_code != 200:
            raise ModelCallFailed(str(outcome.body.get("error", {}).get("message") or outcome.body))
        return outcome.body

    async def chat(self, model: str, messages: list[dict[str, str]], *, schema: dict[str, Any],
                   sampling: JudgeSampling | None) -> JudgeReply:
        tokens = judge_tokens(sampling, self.ctx.settings.max_new_tokens)
        sampling = sampling or JudgeSampling()
        try:
            with session_scope(self.ctx.sessions) as session:
                served = resolve_served_model(session, self.ctx.settings, name=model, tenant=self.tenant)
        except DomainError as exc:
            raise ModelCallFailed(f"{exc.code}: {exc.message}") from exc
        params = SamplingParams(
            max_new_tokens=tokens,
            temperature=0.0 if sampling.temperature is None else sampling.temperature,
            top_p=1.0 if sampling.top_p is None else sampling.top_p, seed=sampling.seed,
            constraint=Constraint(kind="json_schema", spec=json.dumps(schema, sort_keys=True)))
        line = PlannedLine(custom_id="grader", url=CHAT, model=model, path=served.path, adapter=served.adapter,
                           messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages],
                           params=params, tokens_field=JUDGE.name)
        body = self._run(line)
        choice, usage = body["choices"][0], body.get("usage") or {}
        return JudgeReply(text=choice["message"]["content"], prompt_tokens=int(usage.get("prompt_tokens", 0)),
                          completion_tokens=int(usage.get("completion_tokens", 0)),
                          truncated=choice.get("finish_reason") == "length")

    async def embed(self, model: str | None, texts: list[str]) -> list[list[float]]:
        name = model or DEFAULT_EMBEDDING_MODEL
        try:
            with session_scope(self.ctx.sessions) as session:
                path = resolve_embedding_model(session, self.ctx.settings, name=name, tenant=self.tenant,
                                               aliases=builtin_aliases())
        except DomainError as exc:
            raise ModelCallFailed(f"{exc.code}: {exc.message}") from exc
        body = self._run(PlannedLine(custom_id="grader", url=EMBEDDINGS, model=name, path=path, texts=texts))
        return [list(entry["embedding"]) for entry in body["data"]]


def sample_of(result: LineResult, source: CompletionsDataSource, item: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's sample of an output item: the messages sent, the answer, its usage, or the error."""
    response = result.line["response"]
    body = response.get("body") or {}
    sampling = source.sampling_params
    sample: dict[str, Any] = {
        "input": input_messages(source, item), "model": source.model, "output": [], "finish_reason": None,
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0},
        "error": None, "max_completion_tokens": sampling.max_completion_tokens if sampling else None,
        "temperature": sampling.temperature if sampling else None, "top_p": sampling.top_p if sampling else None,
        "seed": sampling.seed if sampling else None}
    if result.failed or response.get("status_code") != 200:
        error = body.get("error") or {}
        sample["error"] = {"code": str(error.get("code") or "error"), "message": str(error.get("message") or "")}
        return sample
    choice = body["choices"][0]
    sample["output"] = [{"role": "assistant", "content": choice["message"]["content"]}]
    sample["finish_reason"] = choice.get("finish_reason")
    usage = body.get("usage") or {}
    sample["usage"] = {"prompt_tokens": int(usage.get("prompt_tokens", 0)),
                       "completion_tokens": int(usage.get("completion_tokens", 0)),
                       "total_tokens": int(usage.get("total_tokens", 0)),
                       "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))}
    return sample


def result_entry(criterion: AnyGrader, graded: Grade) -> dict[str, Any]:
    """One criterion's result on an output item (OpenAI's name, type, score, passed, sample; plus its errors)."""
    entry: dict[str, Any] = {"name": criterion.name, "type": criterion.type, "score": graded.score,
                             "passed": bool(graded.passed), "sample": None}
    if "judge_output" in graded.details:
        entry["sample"] = {"output": [{"role": "assistant", "content": graded.details["judge_output"]}]}
    if graded.sub_scores:
        entry["sub_scores"] = dict(graded.sub_scores)
    if graded.errors:
        entry["errors"] = sorted(graded.errors)
        entry["error_details"] = graded.error_details
    return entry


async def _grade_item(criteria: list[AnyGrader], item: dict[str, Any], sample: dict[str, Any],
                      models: WorkerModels) -> tuple[str, list[dict[str, Any]]]:
    if sample["error"] is not None:
        return "error", [{"name": c.name, "type": c.type, "score": 0.0, "passed": False, "sample": None}
                         for c in criteria]
    text = sample["output"][0]["content"]
    results = [result_entry(c, await grade(c, item=item, sample=sample_namespace(text), models=models))
               for c in criteria]
    return ("pass" if all(r["passed"] for r in results) else "fail"), results


def grade_results(ctx: WorkerContext, batch_id: str, results: list[LineResult], pacer: Pacer) -> None:
    """Grade the items of these stored results that have no grades yet, if the batch is an eval run's."""
    if not results:
        return
    with session_scope(ctx.sessions) as session:
        run = session.scalar(select(EvalRun).where(EvalRun.batch_id == batch_id))
        if run is None:
            return
        criteria_specs = session.scalar(select(Eval.testing_criteria).where(Eval.id == run.eval_id)) or []
        done = graded_ids(session, run_id=run.id)
        run_id, eval_id, tenant = run.id, run.eval_id, run.tenant_id
        source = CompletionsDataSource.model_validate(run.data_source)
    todo = [(int(r.line["custom_id"].removeprefix("item-")), r) for r in results]
    todo = [(index, r) for index, r in todo if index not in done]
    if not todo:
        return
    criteria: list[AnyGrader] = [GRADER.validate_python(spec) for spec in criteria_specs]  # type: ignore[misc]
    items = items_at(ctx.storage, run_id, [index for index, _ in todo])
    models = WorkerModels(ctx, tenant, batch_id, pacer)
    rows = []
    for index, result in todo:
        sample = sample_of(result, source, items[index])
        status, entries = asyncio.run(_grade_item(criteria, items[index], sample, models))
        rows.append(EvalOutputItem(id=new_id("outitem"), run_id=run_id, eval_id=eval_id, datasource_item_id=index,
                                   status=status, sample=sample, results=entries, created_at=utcnow()))
    with session_scope(ctx.sessions) as session:
        # The run's row locked first: two holders of one batch (a lease taken over after a stalled heartbeat) write
        # their grades one after the other, so each sees the other's and exactly one of them sees the run finish.
        run = session.get(EvalRun, run_id, with_for_update=True)
        if run is None:
            return
        graded = graded_ids(session, run_id=run_id)
        new_rows = [row for row in rows if row.datasource_item_id not in graded]
        session.add_all(new_rows)
        count_items(session, run=run, items=new_rows)
        if run.job_id is not None and len(graded) < run.total <= graded_count(session, run_id=run_id):
            report_to_job(session, run)  # with the last grades: once, whatever dies later
    log.info("eval run %s: graded items %d..%d", run_id, todo[0][0], todo[-1][0])


def _counts(run: EvalRun) -> dict[str, Any]:
    by_status, by_criterion, _ = summary(run)
    return {"run_id": run.id, "model": run.model, "passed": by_status["pass"], "total": run.total,
            "pass_rate": by_status["pass"] / run.total if run.total else 0.0,
            "per_testing_criteria": {name: dict(counts) for name, counts in by_criterion.items()}}


_MODEL_NAMES = {"base": "the base model", "fine_tuned": "the fine-tuned model"}  # a job's runs, by role


def report_to_job(session: Session, run: EvalRun) -> None:
    """The job's event for a finished run of its eval: its result, beside the other run's once both have finished
    (the base's usually ends first; on a long eval and a short job the fine-tune's may)."""
    name = session.scalar(select(Eval.name).where(Eval.id == run.eval_id))
    mine = _counts(run)
    line = f"{mine['passed']}/{mine['total']} passed ({mine['pass_rate']:.0%})"
    data: dict[str, Any] = {"eval_id": run.eval_id, "role": run.role, run.role or "run": mine}
    other_role = "base" if run.role == "fine_tuned" else "fine_tuned"
    other = session.scalar(select(EvalRun).where(EvalRun.job_id == run.job_id, EvalRun.role == other_role))
    if other is not None and other.total and graded_count(session, run_id=other.id) >= other.total:
        data[other_role] = theirs = _counts(other)
        line += f"; {_MODEL_NAMES[other_role]} {theirs['passed']}/{theirs['total']} ({theirs['pass_rate']:.0%})"
    model = _MODEL_NAMES[run.role] if run.role == "fine_tuned" else f"{_MODEL_NAMES['base']} {run.model}"
    message = f"eval {name!r} on {model}: {line}"
    assert run.job_id is not None
    add_event(session, job_id=run.job_id, kind=EventKind.EVAL_RUN, message=message, data=data)


def start_fine_tuned_runs(ctx: WorkerContext, job_id: str) -> None:
    """Start the eval runs a succeeded job kept for its fine-tuned model (core.eval_runs), then send their tasks."""
    started = []
    with session_scope(ctx.sessions) as session:
        for run in session.scalars(select(EvalRun).where(EvalRun.job_id == job_id, EvalRun.batch_id.is_(None))):
            try:
                source = CompletionsDataSource.model_validate(run.data_source)
                file_id = source.source.id if isinstance(source.source, FileIdSource) else None
                items = RunItems(key=items_key(run.id))
                started.append(start_run(session, ctx.settings, ctx.storage, run=run, items=items,
                                         file_id=file_id).id)
            except (DomainError, OSError) as exc:  # this run cannot start; the job has succeeded all the same
                log.warning("eval run %s of job %s could not start: %s", run.id, job_id, exc)
                run.status, run.error = RUN_FAILED, {"code": "run_not_started", "message": str(exc)[:500]}
    for batch_id in started:
        with session_scope(ctx.sessions) as session:
            try:
                send_batch(session, ctx.queue, batch_id)
            except BrokerUnavailable:
                log.warning("eval batch %s: the broker refused; the batch reaper sends it", batch_id)

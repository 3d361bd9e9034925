"""Starting an eval run: its items and plan stored, its batch row written (the caller commits, then sends the task).

The API starts a run when a client creates it; a training worker starts a fine-tuning job's "after" run when the
job succeeds (worker.batches.grading). Each item becomes one planned chat line of the model named by the run, so the
run is an ordinary /v1/batches batch (core.batches) that worker.batches.grading grades as its parts are stored.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import ValidationError
from sqlalchemy.orm import Session

from core.batches import IN_PROGRESS, WINDOW, PlannedLine, plan_key
from core.errors import ValidationFailed
from core.evals import IN_PROGRESS as RUN_IN_PROGRESS
from core.evals import CompletionsDataSource, SourceItem, input_messages, items_key
from core.generation_limits import EVAL_RUN, server_refusal
from core.protocol import ChatMessage, SamplingParams
from core.rows import Batch, Dataset, EvalRun, new_id, utcnow
from core.served_models import resolve_served_model
from core.settings import Settings
from core.storage import ArtifactStore

CHAT = "/v1/chat/completions"


def run_sampling(source: CompletionsDataSource, settings: Settings) -> SamplingParams:
    """The run's decoding, as /v1/chat/completions would decode it (422 naming the sampling field at fault)."""
    given = source.sampling_params
    max_tokens, field = EVAL_RUN.chosen({EVAL_RUN.name: given.max_completion_tokens if given else None})
    try:
        params = SamplingParams(max_new_tokens=max_tokens, seed=given.seed if given else None,
                                temperature=1.0 if given is None or given.temperature is None else given.temperature,
                                top_p=1.0 if given is None or given.top_p is None else given.top_p)
    except ValidationError as exc:
        raise ValidationFailed("data_source.sampling_params", str(exc.errors()[0]["msg"])) from exc
    if (refusal := server_refusal(params, field, settings)) is not None:
        raise ValidationFailed(*refusal)
    return params


def _put(storage: ArtifactStore, key: str, data: bytes) -> None:
    local = storage.work_path(key).with_suffix(".part")
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        local.write_bytes(data)
        storage.move_in(local, key)
    finally:
        local.unlink(missing_ok=True)


def store_items(storage: ArtifactStore, run_id: str, items: list[SourceItem]) -> bytes:
    """Keep a run's items (JSON Lines of {"item": ...}); their bytes."""
    data = b"".join(entry.model_dump_json().encode() + b"\n" for entry in items)
    _put(storage, items_key(run_id), data)
    return data


def start_run(session: Session, settings: Settings, storage: ArtifactStore, *, run: EvalRun,
              items: list[SourceItem], file_id: str | None) -> Batch:
    """Store the run's items and plan, add its batch (and, for inline items, their /v1/files entry) and point the
    run at it; the caller commits, then sends core.tasks.TASK_BATCH (the batch reaper sends it if that fails)."""
    source = CompletionsDataSource.model_validate(run.data_source)
    served = resolve_served_model(session, settings, name=run.model, tenant=run.tenant_id)
    params = run_sampling(source, settings)
    batch_id = new_id("batch")
    plan = [PlannedLine(custom_id=f"item-{at}", url=CHAT, model=run.model, path=served.path, adapter=served.adapter,
                        messages=[ChatMessage(role=m["role"], content=m["content"])
                                  for m in input_messages(source, entry.item)], params=params,
                        tokens_field=EVAL_RUN.name)
            for at, entry in enumerate(items)]
    data = store_items(storage, run.id, items)
    _put(storage, plan_key(batch_id), b"".join(line.model_dump_json().encode() + b"\n" for line in plan))
    now = utcnow()
    if file_id is None:
        file_id = new_id("file")
        name = f"{run.id}_items.jsonl"
        session.add(Dataset(id=file_id, tenant_id=run.tenant_id, name=name, filename=name, format="evals",
                            rows=len(items), columns=["item", "sample"], column_stats={},
                            sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), path=items_key(run.id),
                            created_at=now, purpose="evals"))
    batch = Batch(id=batch_id, tenant_id=run.tenant_id, status=IN_PROGRESS, endpoint=CHAT, input_file_id=file_id,
                  completion_window="24h", metadata_={"eval_id": run.eval_id, "eval_run_id": run.id},
                  total=len(items), completed=0, failed=0, lines_done=0, created_at=now, in_progress_at=now,
                  expires_at=now + WINDOW)
    session.add(batch)
    run.batch_id, run.status = batch_id, RUN_IN_PROGRESS
    session.flush()
    return batch


def stored_items(storage: ArtifactStore, run_id: str) -> list[SourceItem]:
    """A run's items as stored when it was created."""
    with storage.open(items_key(run_id)) as stream:
        return [SourceItem.model_validate(json.loads(line)) for line in stream if line.strip()]

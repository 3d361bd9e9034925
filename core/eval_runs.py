"""Starting an eval run: its items and plan stored, its batch row written (the caller commits, then sends the task).

The API starts a run when a client creates it; a training worker starts a fine-tuning job's "after" run when the
job succeeds (worker.batches.grading). Each item becomes one planned chat line of the model named by the run, so the
run is an ordinary /v1/batches batch (core.batches) that worker.batches.grading grades as its parts are stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class RunItems:
    """A run's items: given inline (at most MAX_ITEMS in a request body), or a stored JSON Lines file of
    {"item": ...} (an evals file, a run's kept items) read a line at a time, never whole."""

    inline: list[SourceItem] | None = None
    key: str | None = None

    def read(self, storage: ArtifactStore) -> Iterator[SourceItem]:
        """The items in order (OSError when the store cannot be read)."""
        if self.inline is not None:
            yield from self.inline
            return
        assert self.key is not None
        with storage.open(self.key) as stream:
            for line in stream:
                if line.strip():
                    yield SourceItem.model_validate_json(line)


def items_at(storage: ArtifactStore, run_id: str, indexes: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The items of a run at these indexes, reading its kept items a line at a time up to the last one asked for."""
    wanted = set(indexes)
    found: dict[int, dict[str, Any]] = {}
    if not wanted:
        return found
    last = max(wanted)
    for at, entry in enumerate(RunItems(key=items_key(run_id)).read(storage)):
        if at in wanted:
            found[at] = entry.item
        if at >= last:
            break
    return found


def _put_lines(storage: ArtifactStore, key: str, lines: Iterable[bytes]) -> tuple[int, int, str]:
    """Store lines under `key` through a local part file; their count, bytes and sha256."""
    local = storage.work_path(key).with_suffix(".part")
    local.parent.mkdir(parents=True, exist_ok=True)
    count, size, digest = 0, 0, hashlib.sha256()
    try:
        with open(local, "wb") as out:
            for line in lines:
                out.write(line)
                count, size = count + 1, size + len(line)
                digest.update(line)
        storage.move_in(local, key)
    finally:
        local.unlink(missing_ok=True)
    return count, size, digest.hexdigest()


def store_items(storage: ArtifactStore, run_id: str, items: RunItems) -> tuple[int, int, str]:
    """Keep a run's items (JSON Lines of {"item": ...}, written as they are read); their count, bytes, sha256."""
    return _put_lines(storage, items_key(run_id), (entry.model_dump_json().encode() + b"\n"
                                                   for entry in items.read(storage)))


def start_run(session: Session, settings: Settings, storage: ArtifactStore, *, run: EvalRun,
              items: RunItems, file_id: str | None) -> Batch:
    """Store the run's items and plan, add its batch (and, for inline items, their /v1/files entry) and point the
    run at it; the caller commits, then sends core.tasks.TASK_BATCH (the batch reaper sends it if that fails)."""
    source = CompletionsDataSource.model_validate(run.data_source)
    served = resolve_served_model(session, settings, name=run.model, tenant=run.tenant_id)
    params = run_sampling(source, settings)
    batch_id = new_id("batch")
    count, size, sha256 = store_items(storage, run.id, items)

    def plan() -> Iterator[bytes]:
        for at, entry in enumerate(RunItems(key=items_key(run.id)).read(storage)):
            line = PlannedLine(custom_id=f"item-{at}", url=CHAT, model=run.model, path=served.path,
                               adapter=served.adapter, params=params, tokens_field=EVAL_RUN.name,
                               messages=[ChatMessage(role=m["role"], content=m["content"])
                                         for m in input_messages(source, entry.item)])
            yield line.model_dump_json().encode() + b"\n"

    _put_lines(storage, plan_key(batch_id), plan())
    now = utcnow()
    if file_id is None:
        file_id = new_id("file")
        name = f"{run.id}_items.jsonl"
        session.add(Dataset(id=file_id, tenant_id=run.tenant_id, name=name, filename=name, format="evals",
                            rows=count, columns=["item", "sample"], column_stats={},
                            sha256=sha256, size_bytes=size, path=items_key(run.id),
                            created_at=now, purpose="evals"))
    batch = Batch(id=batch_id, tenant_id=run.tenant_id, status=IN_PROGRESS, endpoint=CHAT, input_file_id=file_id,
                  completion_window="24h", metadata_={"eval_id": run.eval_id, "eval_run_id": run.id},
                  total=count, completed=0, failed=0, lines_done=0, created_at=now, in_progress_at=now,
                  expires_at=now + WINDOW)
    session.add(batch)
    run.batch_id, run.status = batch_id, RUN_IN_PROGRESS
    session.flush()
    return batch

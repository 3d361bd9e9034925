"""Model aliases: create, move (atomic, recorded, optionally gated by an eval), delete, and their lineage.

A move locks the alias row, checks the compare-and-set and the gate, writes the new target, the move record and
the `model_alias.moved` webhook event in one commit: a reader sees the old target or the new one, never a move
without its record. The gate compares pass rates (passed / total) of completed runs of one eval: the new target's
run must beat the current target's latest.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.schemas.aliases import AliasCreate, AliasHistory, AliasList, AliasMove, AliasMoveRead, AliasRead, GateResult
from app.services import evals
from app.services.files import unix
from core.auth import Principal
from core.embeddings import resolve_embedding_model
from core.errors import Conflict, NotFound, ValidationFailed
from core.evals import RUN_COMPLETED
from core.pretrained import builtin_aliases
from core.rows import Artifact, Dataset, EvalRun, Job, ModelAlias, ModelAliasMove, WebhookEventType, new_id, utcnow
from core.served_models import resolve_served_model
from core.settings import Settings
from core.store import aliases as store
from core.store.webhooks import emit


def _check_target(session: Session, settings: Settings, *, tenant: str, target: str) -> None:
    """Refuse a target the alias's tenant cannot be served (another tenant's model is as absent: 404), whoever asks:
    an admin's key sees every tenant, the alias's callers only their own."""
    if store.is_alias_name(target):
        raise ValidationFailed("target", "an alias points at a model, not at another alias")
    try:
        resolve_served_model(session, settings, name=target, tenant=tenant)
    except (NotFound, ValidationFailed) as generation:
        try:  # an embeddings model: the alias serves /v1/embeddings
            resolve_embedding_model(session, settings, name=target, tenant=tenant, aliases=builtin_aliases())
        except (NotFound, ValidationFailed):
            generation.field = "target"
            raise generation from None


def lineage(session: Session, target: str) -> dict[str, object]:
    """Where a target comes from: a job's base model, training dataset and checkpoints; else the model itself."""
    job = session.get(Job, target) if target.startswith("job_") else None
    if job is None:
        return {"model": target}
    dataset = session.get(Dataset, job.train_dataset_id) if job.train_dataset_id else None
    checkpoints = session.scalars(select(Artifact).where(Artifact.job_id == job.id).order_by(Artifact.created_at))
    return {"base_model": job.base_model,
            "dataset": None if dataset is None else {"id": dataset.id, "name": dataset.name, "sha256": dataset.sha256},
            "job": {"id": job.id, "status": job.status, "task": job.task, "adapter": job.adapter,
                    "method": job.method, "metrics": dict(job.metrics or {})},
            "checkpoints": [{"id": a.id, "kind": a.kind, "step": a.step} for a in checkpoints]}


def alias_read(session: Session, alias: ModelAlias) -> AliasRead:
    return AliasRead(id=alias.id, name=alias.name, target=alias.target, gate_eval_id=alias.gate_eval_id,
                     description=alias.description, created_at=unix(alias.created_at) or 0,
                     updated_at=unix(alias.updated_at) or 0, lineage=lineage(session, alias.target))


def _record(session: Session, alias: ModelAlias, principal: Principal, *, before: str | None,
            gate: GateResult | None) -> ModelAliasMove:
    move = ModelAliasMove(id=new_id("move"), alias_id=alias.id, from_target=before, to_target=alias.target,
                          moved_by=principal.key_id, gate=None if gate is None else gate.model_dump(),
                          moved_at=utcnow())
    session.add(move)
    session.flush()
    emit(session, tenant_id=alias.tenant_id, type=WebhookEventType.MODEL_ALIAS_MOVED,
         data={"alias": alias.name, "from": before, "to": alias.target, "moved_by": principal.key_id,
               "gate": move.gate})
    return move


def create_alias(session: Session, settings: Settings, principal: Principal, *, body: AliasCreate) -> ModelAlias:
    """A new alias pointing at a servable model (409 naming `name` when it is taken, also by a create racing this
    one: the unique (tenant, name) index decides, never a 500)."""
    _check_target(session, settings, tenant=principal.tenant_id, target=body.target)
    if body.gate_eval_id is not None:
        evals.get_eval(session, principal, eval_id=body.gate_eval_id)
    taken = Conflict(f"alias {body.name!r} exists; move it with POST /aliases/{body.name}/move", field="name")
    exists = session.scalar(select(ModelAlias.id).where(ModelAlias.tenant_id == principal.tenant_id,
                                                        ModelAlias.name == body.name))
    if exists is not None:
        raise taken
    now = utcnow()
    alias = ModelAlias(id=new_id("alias"), tenant_id=principal.tenant_id, name=body.name, target=body.target,
                       gate_eval_id=body.gate_eval_id, description=body.description, created_at=now, updated_at=now)
    session.add(alias)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise taken from None
    _record(session, alias, principal, before=None, gate=None)
    session.commit()
    return alias


def _completed(session: Session, run: EvalRun) -> tuple[bool, float]:
    """Whether a run completed, and its pass rate."""
    read = evals.run_object(session, run)
    counts = read.result_counts
    return read.status == RUN_COMPLETED, counts.passed / counts.total if counts.total else 0.0


def _latest_completed(session: Session, *, eval_id: str, model: str) -> tuple[EvalRun, float] | None:
    for run in session.scalars(select(EvalRun).where(EvalRun.eval_id == eval_id, EvalRun.model == model)
                               .order_by(EvalRun.created_at.desc())):
        done, score = _completed(session, run)
        if done:
            return run, score
    return None


def check_gate(session: Session, principal: Principal, *, eval_id: str, run_id: str | None, current: str,
               target: str) -> GateResult:
    """The gate's verdict: the new target's run against the current target's latest, on one eval (409 if it
    cannot be decided: a run missing or not completed)."""
    evals.get_eval(session, principal, eval_id=eval_id)
    if run_id is not None:
        run = evals.get_run(session, principal, eval_id=eval_id, run_id=run_id)
        if run.model != target:
            raise ValidationFailed("run_id", f"run {run_id!r} ran {run.model!r}, not the new target {target!r}")
        done, score = _completed(session, run)
        if not done:
            raise Conflict(f"run {run_id!r} has not completed; the gate compares completed runs", field="run_id")
        candidate: tuple[EvalRun, float] | None = (run, score)
    else:
        candidate = _latest_completed(session, eval_id=eval_id, model=target)
    if candidate is None:
        raise Conflict(f"no completed run of {target!r} on eval {eval_id!r}; run the eval on it first",
                       field="run_id")
    baseline = _latest_completed(session, eval_id=eval_id, model=current)
    if baseline is None:
        raise Conflict(f"no completed run of the current target {current!r} on eval {eval_id!r}; run the eval on "
                       "it first", field="eval_id")
    return GateResult(eval_id=eval_id, run_id=candidate[0].id, score=candidate[1], baseline_run_id=baseline[0].id,
                      baseline_score=baseline[1], passed=candidate[1] > baseline[1])


def move_alias(session: Session, settings: Settings, principal: Principal, *, name: str, body: AliasMove
               ) -> ModelAlias:
    """Point the alias at `target`: atomically, recorded, and only if its gate (if any) passes (409 otherwise)."""
    tenant = store.find_alias(session, name=name, tenant=principal.scope, field="name").tenant_id
    _check_target(session, settings, tenant=tenant, target=body.target)  # before the lock: it may read model files
    alias = store.find_alias(session, name=name, tenant=principal.scope, for_update=True, field="name")
    if body.expected_target is not None and alias.target != body.expected_target:
        raise Conflict(f"alias {name!r} points at {alias.target!r}, not {body.expected_target!r}",
                       field="expected_target")
    if alias.target == body.target:
        return alias
    eval_id = body.eval_id or alias.gate_eval_id
    gate = None
    if eval_id is not None:
        gate = check_gate(session, principal, eval_id=eval_id, run_id=body.run_id, current=alias.target,
                          target=body.target)
        if not gate.passed:
            raise Conflict(f"the gate refused the move: {body.target!r} scored {gate.score:.3f} on eval {eval_id!r}, "
                           f"not above {alias.target!r}'s {gate.baseline_score:.3f}", field="target",
                           details=gate.model_dump())
    before = alias.target
    alias.target, alias.updated_at = body.target, utcnow()
    _record(session, alias, principal, before=before, gate=gate)
    session.commit()
    return alias


def get_alias(session: Session, principal: Principal, *, name: str) -> ModelAlias:
    return store.find_alias(session, name=name, tenant=principal.scope, field="name")


def list_all(session: Session, principal: Principal) -> AliasList:
    return AliasList(data=[alias_read(session, a) for a in store.list_aliases(session, tenant=principal.scope)])


def history(session: Session, principal: Principal, *, name: str) -> AliasHistory:
    alias = get_alias(session, principal, name=name)
    return AliasHistory(data=[AliasMoveRead(id=m.id, alias=alias.name, from_target=m.from_target,
                                            to_target=m.to_target, moved_by=m.moved_by,
                                            moved_at=unix(m.moved_at) or 0,
                                            gate=None if m.gate is None else GateResult(**m.gate))
                              for m in store.history(session, alias_id=alias.id)])


def delete_alias(session: Session, principal: Principal, *, name: str) -> None:
    """Delete the alias; of deletes racing each other one finds it (the row lock orders them), the rest a 404."""
    session.delete(store.find_alias(session, name=name, tenant=principal.scope, for_update=True, field="name"))
    session.commit()

"""Data access for evals, their runs and output items."""

from __future__ import annotations

from collections import Counter

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.rows import Eval, EvalOutputItem, EvalRun
from core.store.owned import get_owned
from core.store.paging import newest_first


def get_eval(session: Session, *, eval_id: str, tenant: str | None) -> Eval:
    """One eval visible to `tenant`, or NotFound."""
    return get_owned(session, Eval, eval_id, what="eval", tenant=tenant)


def list_evals(session: Session, *, tenant: str | None, limit: int, after: tuple[str, str] | None) -> list[Eval]:
    """Newest first."""
    return list(session.scalars(newest_first(Eval, tenant=tenant, limit=limit, after=after)))


def get_run(session: Session, *, eval_id: str, run_id: str, tenant: str | None) -> EvalRun:
    """One run of the eval, or NotFound."""
    run = get_owned(session, EvalRun, run_id, what="eval run", tenant=tenant)
    if run.eval_id != eval_id:
        from core.errors import NotFound

        raise NotFound(f"eval run {run_id!r} not found")
    return run


def list_runs(session: Session, *, eval_id: str, limit: int, after: tuple[str, str] | None) -> list[EvalRun]:
    """An eval's runs, newest first."""
    query = newest_first(EvalRun, tenant=None, limit=limit, after=after).where(EvalRun.eval_id == eval_id)
    return list(session.scalars(query))


def list_output_items(session: Session, *, run_id: str, limit: int, after: int | None, status: str | None,
                      ascending: bool = True) -> list[EvalOutputItem]:
    """A run's graded items by item index; `after` is the previous page's last index."""
    order = EvalOutputItem.datasource_item_id
    query = select(EvalOutputItem).where(EvalOutputItem.run_id == run_id) \
        .order_by(order.asc() if ascending else order.desc()).limit(limit)
    if after is not None:
        query = query.where(order > after if ascending else order < after)
    if status is not None:
        query = query.where(EvalOutputItem.status == status)
    return list(session.scalars(query))


def graded_ids(session: Session, *, run_id: str) -> set[int]:
    """The item indexes of a run that already have their grades."""
    return set(session.scalars(select(EvalOutputItem.datasource_item_id).where(EvalOutputItem.run_id == run_id)))


def graded_count(session: Session, *, run_id: str) -> int:
    return int(session.scalar(select(func.count()).where(EvalOutputItem.run_id == run_id)) or 0)


Summary = tuple[Counter[str], dict[str, Counter[str]], dict[str, dict[str, int]]]
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


def count_items(session: Session, *, run: EvalRun, items: list[EvalOutputItem]) -> None:
    """Add newly stored output items to their run's counts, in the transaction that stores them: the caller holds
    the run's row lock (SELECT ... FOR UPDATE), so concurrent graders of one run add up and a rollback adds none."""
    by_status = Counter(item.status for item in items)
    run.passed = EvalRun.passed + by_status["pass"]  # type: ignore[assignment]
    run.failed = EvalRun.failed + by_status["fail"]  # type: ignore[assignment]
    run.errored = EvalRun.errored + by_status["error"]  # type: ignore[assignment]
    criteria = {name: dict(counts) for name, counts in (run.criteria_counts or {}).items()}
    usage = {model: dict(counts) for model, counts in (run.model_usage or {}).items()}
    for item in items:
        for result in item.results:
            counts = criteria.setdefault(result["name"], {"passed": 0, "failed": 0})
            counts["passed" if result.get("passed") else "failed"] += 1
        tokens = item.sample.get("usage") or {}
        total = usage.setdefault(str(item.sample.get("model") or ""),
                                 {"invocation_count": 0, **{key: 0 for key in USAGE_KEYS}})
        total["invocation_count"] += 1
        for key in USAGE_KEYS:
            total[key] += int(tokens.get(key) or 0)
    run.criteria_counts, run.model_usage = criteria, usage
    session.flush()


def summary(run: EvalRun) -> Summary:
    """A run's counts as kept on its row: items by status, each criterion's passed/failed, tokens by model."""
    by_status = Counter({"pass": run.passed, "fail": run.failed, "error": run.errored})
    by_criterion = {name: Counter(counts) for name, counts in (run.criteria_counts or {}).items()}
    return by_status, by_criterion, dict(run.model_usage or {})

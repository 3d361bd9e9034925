"""eval run counts: passed, failed, errored, per criterion and per model, kept on the run as items are graded

Revision ID: 0012e
Revises: 0011h
Create Date: 2026-12-06 09:00:00.000000
"""
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0012e'
down_revision: str | None = '0011h'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


def upgrade() -> None:
    with op.batch_alter_table('eval_runs') as batch:
        for name in ('passed', 'failed', 'errored'):
            batch.add_column(sa.Column(name, sa.Integer(), server_default='0', nullable=False))
        batch.add_column(sa.Column('criteria_counts', sa.JSON(), server_default='{}', nullable=False))
        batch.add_column(sa.Column('model_usage', sa.JSON(), server_default='{}', nullable=False))
    _count_graded_items()


def _count_graded_items() -> None:
    """The runs graded before this revision: their counts from their output items, a run at a time."""
    bind = op.get_bind()
    runs = sa.table('eval_runs', sa.column('id', sa.String), sa.column('passed', sa.Integer),
                    sa.column('failed', sa.Integer), sa.column('errored', sa.Integer),
                    sa.column('criteria_counts', sa.JSON), sa.column('model_usage', sa.JSON))
    items = sa.table('eval_output_items', sa.column('run_id', sa.String), sa.column('status', sa.String),
                     sa.column('results', sa.JSON), sa.column('sample', sa.JSON))
    for run_id in list(bind.scalars(sa.select(items.c.run_id).distinct())):
        statuses = {"pass": 0, "fail": 0, "error": 0}
        criteria: dict[str, dict[str, int]] = {}
        usage: dict[str, dict[str, Any]] = {}
        for status, results, sample in bind.execute(sa.select(items.c.status, items.c.results, items.c.sample)
                                                    .where(items.c.run_id == run_id)):
            statuses[status] = statuses.get(status, 0) + 1
            for result in results or []:
                counts = criteria.setdefault(result["name"], {"passed": 0, "failed": 0})
                counts["passed" if result.get("passed") else "failed"] += 1
            tokens = (sample or {}).get("usage") or {}
            total = usage.setdefault(str((sample or {}).get("model") or ""),
                                     {"invocation_count": 0, **{key: 0 for key in USAGE_KEYS}})
            total["invocation_count"] += 1
            for key in USAGE_KEYS:
                total[key] += int(tokens.get(key) or 0)
        bind.execute(runs.update().where(runs.c.id == run_id).values(
            passed=statuses["pass"], failed=statuses["fail"], errored=statuses["error"], criteria_counts=criteria,
            model_usage=usage))


def downgrade() -> None:
    with op.batch_alter_table('eval_runs') as batch:
        for name in ('model_usage', 'criteria_counts', 'errored', 'failed', 'passed'):
            batch.drop_column(name)

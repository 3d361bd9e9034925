"""evals: OpenAI's /v1/evals, their runs and each run's graded output items

Revision ID: 0009e
Revises: 0008b
Create Date: 2026-12-02 04:30:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009e'
down_revision: str | None = '0008b'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'evals',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('name', sa.String(length=256), nullable=False),
        sa.Column('data_source_config', sa.JSON(), nullable=False),
        sa.Column('testing_criteria', sa.JSON(), nullable=False),
        sa.Column('metadata', sa.JSON(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_evals')),
    )
    op.create_index(op.f('ix_evals_tenant_id'), 'evals', ['tenant_id'], unique=False)
    op.create_index(op.f('ix_evals_created_at'), 'evals', ['created_at'], unique=False)
    op.create_table(
        'eval_runs',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('eval_id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('name', sa.String(length=256), nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('data_source', sa.JSON(), nullable=False),
        sa.Column('total', sa.Integer(), nullable=False),
        sa.Column('batch_id', sa.String(length=40), nullable=True),
        sa.Column('job_id', sa.String(length=40), nullable=True),
        sa.Column('role', sa.String(length=16), nullable=True),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('error', sa.JSON(), nullable=True),
        sa.Column('metadata', sa.JSON(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['eval_id'], ['evals.id'], name=op.f('fk_eval_runs_eval_id_evals'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_eval_runs_job_id_jobs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_eval_runs')),
    )
    for column in ('eval_id', 'tenant_id', 'batch_id', 'job_id', 'created_at'):
        op.create_index(op.f(f'ix_eval_runs_{column}'), 'eval_runs', [column], unique=False)
    op.create_table(
        'eval_output_items',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('run_id', sa.String(length=40), nullable=False),
        sa.Column('eval_id', sa.String(length=40), nullable=False),
        sa.Column('datasource_item_id', sa.Integer(), nullable=False),
        sa.Column('status', sa.String(length=8), nullable=False),
        sa.Column('sample', sa.JSON(), nullable=False),
        sa.Column('results', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['eval_runs.id'], name=op.f('fk_eval_output_items_run_id_eval_runs'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_eval_output_items')),
        sa.UniqueConstraint('run_id', 'datasource_item_id', name='uq_eval_output_items_run_item'),
    )
    op.create_index(op.f('ix_eval_output_items_run_id'), 'eval_output_items', ['run_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_eval_output_items_run_id'), table_name='eval_output_items')
    op.drop_table('eval_output_items')
    for column in ('eval_id', 'tenant_id', 'batch_id', 'job_id', 'created_at'):
        op.drop_index(op.f(f'ix_eval_runs_{column}'), table_name='eval_runs')
    op.drop_table('eval_runs')
    op.drop_index(op.f('ix_evals_created_at'), table_name='evals')
    op.drop_index(op.f('ix_evals_tenant_id'), table_name='evals')
    op.drop_table('evals')

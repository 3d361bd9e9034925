"""best checkpoints, early stopping and sweeps

Revision ID: 0005e
Revises: 0005p
Create Date: 2026-11-30 06:10:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.rows

revision: str = '0005e'
down_revision: str | None = '0005p'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'sweeps',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('method', sa.String(length=16), nullable=False),
        sa.Column('parameters', sa.JSON(), nullable=False),
        sa.Column('job_spec', sa.JSON(), nullable=False),
        sa.Column('template', sa.JSON(), nullable=False),
        sa.Column('trials', sa.JSON(), nullable=False),
        sa.Column('parallelism', sa.Integer(), nullable=False),
        sa.Column('metric', sa.String(length=64), nullable=False),
        sa.Column('greater_is_better', sa.Boolean(), nullable=False),
        sa.Column('pruning', sa.JSON(), nullable=True),
        sa.Column('best_job_id', sa.String(length=40), nullable=True),
        sa.Column('created_at', core.rows.UTCDateTime(timezone=True), nullable=False),
        sa.Column('finished_at', core.rows.UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_sweeps')),
    )
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sweeps_tenant_id'), ['tenant_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_sweeps_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_sweeps_created_at'), ['created_at'], unique=False)
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('best', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('stop_reason', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('sweep_id', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('sweep_index', sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f('ix_jobs_sweep_id'), ['sweep_id'], unique=False)
        batch_op.create_foreign_key(batch_op.f('fk_jobs_sweep_id_sweeps'), 'sweeps', ['sweep_id'], ['id'],
                                    ondelete='SET NULL')
        batch_op.create_unique_constraint('uq_jobs_sweep_id_sweep_index', ['sweep_id', 'sweep_index'])


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_constraint('uq_jobs_sweep_id_sweep_index', type_='unique')
        batch_op.drop_constraint(batch_op.f('fk_jobs_sweep_id_sweeps'), type_='foreignkey')
        batch_op.drop_index(batch_op.f('ix_jobs_sweep_id'))
        batch_op.drop_column('sweep_index')
        batch_op.drop_column('sweep_id')
        batch_op.drop_column('stop_reason')
        batch_op.drop_column('best')
    with op.batch_alter_table('sweeps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sweeps_created_at'))
        batch_op.drop_index(batch_op.f('ix_sweeps_status'))
        batch_op.drop_index(batch_op.f('ix_sweeps_tenant_id'))
    op.drop_table('sweeps')

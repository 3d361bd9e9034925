"""outbox: task messages written with the state change that needs them

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 03:10:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.rows

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'outbox',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('task', sa.String(length=100), nullable=False),
        sa.Column('queue', sa.String(length=40), nullable=False),
        sa.Column('args', sa.JSON(), nullable=False),
        sa.Column('created_at', core.rows.UTCDateTime(timezone=True), nullable=False),
        sa.Column('sent_at', core.rows.UTCDateTime(timezone=True), nullable=True),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_outbox_job_id_jobs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox')),
    )
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_outbox_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_outbox_sent_at'), ['sent_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_outbox_sent_at'))
        batch_op.drop_index(batch_op.f('ix_outbox_job_id'))
    op.drop_table('outbox')

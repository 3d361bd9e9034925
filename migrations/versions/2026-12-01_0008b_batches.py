"""batches: OpenAI's /v1/batches, one row per batch with its status, counts and files

Revision ID: 0008b
Revises: 0007o
Create Date: 2026-12-01 11:20:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008b'
down_revision: str | None = '0007o'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MOMENTS = ('in_progress_at', 'finalizing_at', 'completed_at', 'failed_at', 'expired_at', 'cancelling_at',
           'cancelled_at')


def upgrade() -> None:
    op.create_table(
        'batches',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('endpoint', sa.String(length=40), nullable=False),
        sa.Column('input_file_id', sa.String(length=40), nullable=False),
        sa.Column('completion_window', sa.String(length=8), nullable=False),
        sa.Column('metadata', sa.JSON(), nullable=True),
        sa.Column('output_file_id', sa.String(length=40), nullable=True),
        sa.Column('error_file_id', sa.String(length=40), nullable=True),
        sa.Column('errors', sa.JSON(), nullable=True),
        sa.Column('total', sa.Integer(), nullable=False),
        sa.Column('completed', sa.Integer(), nullable=False),
        sa.Column('failed', sa.Integer(), nullable=False),
        sa.Column('lines_done', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
        *(sa.Column(name, sa.DateTime(timezone=True), nullable=True) for name in MOMENTS),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_batches')),
    )
    op.create_index(op.f('ix_batches_tenant_id'), 'batches', ['tenant_id'], unique=False)
    op.create_index(op.f('ix_batches_created_at'), 'batches', ['created_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_batches_created_at'), table_name='batches')
    op.drop_index(op.f('ix_batches_tenant_id'), table_name='batches')
    op.drop_table('batches')

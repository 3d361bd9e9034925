"""responses: /v1/responses answers kept per tenant for retrieval and previous_response_id, until they expire

Revision ID: 0013r
Revises: 0012e
Create Date: 2026-12-06 23:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013r'
down_revision: str | None = '0012e'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'responses',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('model', sa.String(length=200), nullable=False),
        sa.Column('previous_response_id', sa.String(length=40), nullable=True),
        sa.Column('context', sa.JSON(), nullable=False),
        sa.Column('input_items', sa.JSON(), nullable=False),
        sa.Column('body', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_responses')),
    )
    op.create_index(op.f('ix_responses_tenant_id'), 'responses', ['tenant_id'], unique=False)
    op.create_index(op.f('ix_responses_expires_at'), 'responses', ['expires_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_responses_expires_at'), table_name='responses')
    op.drop_index(op.f('ix_responses_tenant_id'), table_name='responses')
    op.drop_table('responses')

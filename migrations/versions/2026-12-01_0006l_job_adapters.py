"""job adapters: a job's LoRA settings and training method (sft or dpo)

Revision ID: 0006l
Revises: 0005t
Create Date: 2026-12-01 06:30:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006l'
down_revision: str | None = '0005t'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('adapter', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('method', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('method')
        batch_op.drop_column('adapter')

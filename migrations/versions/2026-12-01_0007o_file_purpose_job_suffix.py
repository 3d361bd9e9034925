"""file purpose and job suffix: /v1/files' purpose on datasets, /v1/fine_tuning/jobs' suffix on jobs

Revision ID: 0007o
Revises: 0006l
Create Date: 2026-12-01 10:40:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007o'
down_revision: str | None = '0006l'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('purpose', sa.String(length=20), nullable=True))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('suffix', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('suffix')
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_column('purpose')

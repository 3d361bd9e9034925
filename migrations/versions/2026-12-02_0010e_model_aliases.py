"""model aliases: a tenant's names for served models, and every move of each

Revision ID: 0010e
Revises: 0009e
Create Date: 2026-12-02 05:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010e'
down_revision: str | None = '0009e'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'model_aliases',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('name', sa.String(length=130), nullable=False),
        sa.Column('target', sa.String(length=200), nullable=False),
        sa.Column('gate_eval_id', sa.String(length=40), nullable=True),
        sa.Column('description', sa.String(length=500), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_model_aliases')),
        sa.UniqueConstraint('tenant_id', 'name', name='uq_model_aliases_tenant_name'),
    )
    op.create_index(op.f('ix_model_aliases_tenant_id'), 'model_aliases', ['tenant_id'], unique=False)
    op.create_table(
        'model_alias_moves',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('alias_id', sa.String(length=40), nullable=False),
        sa.Column('from_target', sa.String(length=200), nullable=True),
        sa.Column('to_target', sa.String(length=200), nullable=False),
        sa.Column('moved_by', sa.String(length=40), nullable=False),
        sa.Column('gate', sa.JSON(), nullable=True),
        sa.Column('moved_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['alias_id'], ['model_aliases.id'],
                                name=op.f('fk_model_alias_moves_alias_id_model_aliases'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_model_alias_moves')),
    )
    op.create_index(op.f('ix_model_alias_moves_alias_id'), 'model_alias_moves', ['alias_id'], unique=False)
    op.create_index(op.f('ix_model_alias_moves_moved_at'), 'model_alias_moves', ['moved_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_model_alias_moves_moved_at'), table_name='model_alias_moves')
    op.drop_index(op.f('ix_model_alias_moves_alias_id'), table_name='model_alias_moves')
    op.drop_table('model_alias_moves')
    op.drop_index(op.f('ix_model_aliases_tenant_id'), table_name='model_aliases')
    op.drop_table('model_aliases')

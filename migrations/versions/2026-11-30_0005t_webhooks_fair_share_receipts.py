"""webhooks, fair-share scheduling columns and reproducibility receipts

Revision ID: 0005t
Revises: 0005m
Create Date: 2026-11-30 06:20:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.rows

revision: str = '0005t'
down_revision: str | None = '0005m'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC = core.rows.UTCDateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('priority', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('claimed_at', UTC, nullable=True))
        batch_op.add_column(sa.Column('run_seconds', sa.Float(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('receipt', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('rerun_of', sa.String(length=40), nullable=True))
        batch_op.create_index('ix_jobs_status_tenant_id', ['status', 'tenant_id'], unique=False)
    op.create_table(
        'webhook_endpoints',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('url', sa.String(length=2000), nullable=False),
        sa.Column('description', sa.String(length=200), nullable=False),
        sa.Column('event_types', sa.JSON(), nullable=False),
        sa.Column('secret', sa.String(length=100), nullable=False),
        sa.Column('previous_secret', sa.String(length=100), nullable=True),
        sa.Column('previous_secret_until', UTC, nullable=True),
        sa.Column('created_at', UTC, nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_endpoints')),
    )
    op.create_index(op.f('ix_webhook_endpoints_tenant_id'), 'webhook_endpoints', ['tenant_id'], unique=False)
    op.create_table(
        'webhook_events',
        sa.Column('id', sa.String(length=40), nullable=False),
        sa.Column('tenant_id', sa.String(length=64), nullable=False),
        sa.Column('type', sa.String(length=40), nullable=False),
        sa.Column('payload', sa.Text(), nullable=False),
        sa.Column('created_at', UTC, nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_events')),
    )
    op.create_index(op.f('ix_webhook_events_tenant_id'), 'webhook_events', ['tenant_id'], unique=False)
    op.create_index(op.f('ix_webhook_events_created_at'), 'webhook_events', ['created_at'], unique=False)
    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('event_id', sa.String(length=40), nullable=False),
        sa.Column('endpoint_id', sa.String(length=40), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', UTC, nullable=False),
        sa.Column('created_at', UTC, nullable=False),
        sa.Column('finished_at', UTC, nullable=True),
        sa.ForeignKeyConstraint(['event_id'], ['webhook_events.id'],
                                name=op.f('fk_webhook_deliveries_event_id_webhook_events'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'],
                                name=op.f('fk_webhook_deliveries_endpoint_id_webhook_endpoints'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_deliveries')),
    )
    op.create_index(op.f('ix_webhook_deliveries_event_id'), 'webhook_deliveries', ['event_id'], unique=False)
    op.create_index(op.f('ix_webhook_deliveries_endpoint_id'), 'webhook_deliveries', ['endpoint_id'], unique=False)
    op.create_index('ix_webhook_deliveries_status_next', 'webhook_deliveries', ['status', 'next_attempt_at'],
                    unique=False)
    op.create_table(
        'webhook_attempts',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('delivery_id', sa.Integer(), nullable=False),
        sa.Column('attempted_at', UTC, nullable=False),
        sa.Column('duration_ms', sa.Float(), nullable=False),
        sa.Column('status_code', sa.Integer(), nullable=True),
        sa.Column('response_body', sa.Text(), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(['delivery_id'], ['webhook_deliveries.id'],
                                name=op.f('fk_webhook_attempts_delivery_id_webhook_deliveries'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_attempts')),
    )
    op.create_index(op.f('ix_webhook_attempts_delivery_id'), 'webhook_attempts', ['delivery_id'], unique=False)


def downgrade() -> None:
    op.drop_table('webhook_attempts')
    op.drop_table('webhook_deliveries')
    op.drop_table('webhook_events')
    op.drop_table('webhook_endpoints')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_status_tenant_id')
        for column in ('rerun_of', 'receipt', 'run_seconds', 'claimed_at', 'priority'):
            batch_op.drop_column(column)

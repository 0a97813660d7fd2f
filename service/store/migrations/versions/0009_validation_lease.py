"""suites.validation_owner, validation_heartbeat_at: a suite validation holds a lease like a run

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('suites', schema=None) as batch_op:
        batch_op.add_column(sa.Column('validation_owner', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('validation_heartbeat_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('suites', schema=None) as batch_op:
        batch_op.drop_column('validation_heartbeat_at')
        batch_op.drop_column('validation_owner')

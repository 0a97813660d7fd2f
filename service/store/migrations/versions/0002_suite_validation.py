"""suite validation

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table('suites', schema=None) as batch_op:
        batch_op.add_column(sa.Column('validation_status', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('validated_at', sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('validation', JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_column('validation')

    with op.batch_alter_table('suites', schema=None) as batch_op:
        batch_op.drop_column('validated_at')
        batch_op.drop_column('validation_status')


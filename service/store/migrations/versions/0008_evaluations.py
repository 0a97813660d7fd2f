"""evaluations: predictions graded like the SWE-bench harness, one row per prediction

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    op.create_table(
        'evaluations',
        sa.Column('id', sa.Uuid(), nullable=False),
        sa.Column('suite_id', sa.Uuid(), nullable=False),
        sa.Column('run_id', sa.String(length=200), nullable=False),
        sa.Column('model_name_or_path', sa.String(length=500), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('config', JSON, nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('owner', sa.String(length=200), nullable=True),
        sa.Column('owner_heartbeat_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('report', JSON, nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(['suite_id'], ['suites.id'], name=op.f('fk_evaluations_suite_id_suites'),
                                ondelete='RESTRICT'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_evaluations')),
        sa.UniqueConstraint('suite_id', 'run_id', 'model_name_or_path',
                            name=op.f('uq_evaluations_suite_id_run_id_model_name_or_path')),
    )
    op.create_index(op.f('ix_evaluations_status'), 'evaluations', ['status'], unique=False)
    op.create_table(
        'evaluation_instances',
        sa.Column('evaluation_id', sa.Uuid(), nullable=False),
        sa.Column('instance_id', sa.String(length=256), nullable=False),
        sa.Column('task_id', sa.Uuid(), nullable=False),
        sa.Column('model_patch', sa.Text(), nullable=True),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('report', JSON, nullable=True),
        sa.Column('test_output', sa.Text(), nullable=True),
        sa.Column('error', sa.Text(), nullable=True),
        sa.Column('graded_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['evaluation_id'], ['evaluations.id'],
                                name=op.f('fk_evaluation_instances_evaluation_id_evaluations'), ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_evaluation_instances_task_id_tasks'),
                                ondelete='RESTRICT'),
        sa.PrimaryKeyConstraint('evaluation_id', 'instance_id', name=op.f('pk_evaluation_instances')),
    )
    op.create_index(op.f('ix_evaluation_instances_evaluation_id_status'), 'evaluation_instances',
                    ['evaluation_id', 'status'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_evaluation_instances_evaluation_id_status'), table_name='evaluation_instances')
    op.drop_table('evaluation_instances')
    op.drop_index(op.f('ix_evaluations_status'), table_name='evaluations')
    op.drop_table('evaluations')

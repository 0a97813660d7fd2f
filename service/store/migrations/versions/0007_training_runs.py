"""training runs: runs.kind, parent_id, policy_version, exhausted_at; groups.seq and epoch
(a task may have a group per epoch: groups are unique by their place in the run's schedule)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('kind', sa.String(length=16), nullable=False, server_default='sample'))
        batch_op.add_column(sa.Column('parent_id', sa.Uuid(), nullable=True))
        batch_op.add_column(sa.Column('policy_version', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('exhausted_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_runs_parent_id_runs'), 'runs', ['parent_id'], ['id'],
                                    ondelete='CASCADE')
        batch_op.create_index(batch_op.f('ix_runs_parent_id'), ['parent_id'], unique=False)

    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.add_column(sa.Column('seq', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('epoch', sa.Integer(), nullable=False, server_default='0'))
    # existing groups: their place in their run, in creation order
    op.execute("UPDATE groups SET seq = (SELECT count(*) FROM groups AS g2 WHERE g2.run_id = groups.run_id "
               "AND (g2.created_at < groups.created_at OR (g2.created_at = groups.created_at AND g2.id < groups.id)))")
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.alter_column('seq', existing_type=sa.Integer(), nullable=False)
        batch_op.drop_constraint('uq_groups_run_id_task_id', type_='unique')
        batch_op.create_unique_constraint(batch_op.f('uq_groups_run_id_seq'), ['run_id', 'seq'])
        batch_op.create_index(batch_op.f('ix_groups_run_id_task_id'), ['run_id', 'task_id'], unique=False)


def downgrade() -> None:
    # a task sampled in several epochs keeps only its first group
    op.execute("DELETE FROM groups WHERE epoch > 0")
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_groups_run_id_task_id'))
        batch_op.drop_constraint(batch_op.f('uq_groups_run_id_seq'), type_='unique')
        batch_op.create_unique_constraint('uq_groups_run_id_task_id', ['run_id', 'task_id'])
        batch_op.drop_column('epoch')
        batch_op.drop_column('seq')

    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_parent_id'))
        batch_op.drop_constraint(batch_op.f('fk_runs_parent_id_runs'), type_='foreignkey')
        batch_op.drop_column('exhausted_at')
        batch_op.drop_column('policy_version')
        batch_op.drop_column('parent_id')
        batch_op.drop_column('kind')

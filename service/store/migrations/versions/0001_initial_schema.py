"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table('policies',
    sa.Column('version', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('weights_path', sa.Text(), nullable=True),
    sa.Column('trainer_step', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('info', JSON, nullable=True),
    sa.PrimaryKeyConstraint('version', name=op.f('pk_policies'))
    )
    op.create_table('suites',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('task_count', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_suites'))
    )
    with op.batch_alter_table('suites', schema=None) as batch_op:
        batch_op.create_index('uq_suites_live_name', ['name'], unique=True, postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))

    op.create_table('runs',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('suite_id', sa.Uuid(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('config', JSON, nullable=False),
    sa.Column('config_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('owner_heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['suite_id'], ['suites.id'], name=op.f('fk_runs_suite_id_suites'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_suite_id'), ['suite_id'], unique=False)

    op.create_table('tasks',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('suite_id', sa.Uuid(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('instance_id', sa.String(length=256), nullable=False),
    sa.Column('repo', sa.String(length=256), nullable=False),
    sa.Column('base_commit', sa.String(length=64), nullable=False),
    sa.Column('problem_statement', sa.Text(), nullable=False),
    sa.Column('test_patch', sa.Text(), nullable=False),
    sa.Column('patch', sa.Text(), nullable=True),
    sa.Column('fail_to_pass', JSON, nullable=False),
    sa.Column('pass_to_pass', JSON, nullable=False),
    sa.Column('version', sa.String(length=64), nullable=True),
    sa.Column('environment_setup_commit', sa.String(length=64), nullable=True),
    sa.Column('hints_text', sa.Text(), nullable=True),
    sa.Column('task_created_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('source', sa.Text(), nullable=True),
    sa.Column('image', sa.Text(), nullable=True),
    sa.Column('install', JSON, nullable=True),
    sa.Column('test_cmd', sa.Text(), nullable=True),
    sa.Column('log_parser', sa.String(length=64), nullable=False),
    sa.Column('extra', JSON, nullable=True),
    sa.ForeignKeyConstraint(['suite_id'], ['suites.id'], name=op.f('fk_tasks_suite_id_suites'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tasks')),
    sa.UniqueConstraint('suite_id', 'instance_id', name=op.f('uq_tasks_suite_id_instance_id'))
    )
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tasks_suite_id_position'), ['suite_id', 'position'], unique=False)
        batch_op.create_index(batch_op.f('ix_tasks_suite_id_repo'), ['suite_id', 'repo'], unique=False)

    op.create_table('groups',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('run_id', sa.Uuid(), nullable=False),
    sa.Column('task_id', sa.Uuid(), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('min_policy_version', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ready_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('claim_id', sa.Uuid(), nullable=True),
    sa.Column('claim_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('consumed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('trainer_step', sa.Integer(), nullable=True),
    sa.Column('dropped_reason', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_groups_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_groups_task_id_tasks'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_groups')),
    sa.UniqueConstraint('run_id', 'task_id', name=op.f('uq_groups_run_id_task_id'))
    )
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_groups_claim_id'), ['claim_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_groups_status_ready_at'), ['status', 'ready_at'], unique=False)

    op.create_table('episodes',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('run_id', sa.Uuid(), nullable=False),
    sa.Column('group_id', sa.Uuid(), nullable=False),
    sa.Column('task_id', sa.Uuid(), nullable=False),
    sa.Column('sample_index', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('trainable', sa.Boolean(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('report', JSON, nullable=True),
    sa.Column('policy_version_min', sa.Integer(), nullable=True),
    sa.Column('policy_version_max', sa.Integer(), nullable=True),
    sa.Column('n_turns', sa.Integer(), nullable=False),
    sa.Column('input_tokens', sa.Integer(), nullable=False),
    sa.Column('output_tokens', sa.Integer(), nullable=False),
    sa.Column('segment_starts', JSON, nullable=True),
    sa.Column('diff', sa.Text(), nullable=True),
    sa.Column('config_hash', sa.String(length=64), nullable=True),
    sa.Column('sandbox_id', sa.String(length=200), nullable=True),
    sa.Column('image', sa.Text(), nullable=True),
    sa.Column('error_type', sa.String(length=200), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('graded_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['group_id'], ['groups.id'], name=op.f('fk_episodes_group_id_groups'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_episodes_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_episodes_task_id_tasks'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_episodes')),
    sa.UniqueConstraint('group_id', 'sample_index', name=op.f('uq_episodes_group_id_sample_index'))
    )
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_episodes_run_id_finished_at'), ['run_id', 'finished_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_episodes_run_id_status'), ['run_id', 'status'], unique=False)
        batch_op.create_index(batch_op.f('ix_episodes_run_id_task_id'), ['run_id', 'task_id'], unique=False)

    op.create_table('turns',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('episode_id', sa.Uuid(), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('segment', sa.Integer(), nullable=False),
    sa.Column('input_ids', sa.LargeBinary(), nullable=False),
    sa.Column('output_ids', sa.LargeBinary(), nullable=False),
    sa.Column('output_logprobs', sa.LargeBinary(), nullable=True),
    sa.Column('routed_experts', sa.LargeBinary(), nullable=True),
    sa.Column('n_input_tokens', sa.Integer(), nullable=False),
    sa.Column('n_output_tokens', sa.Integer(), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('text', sa.Text(), nullable=True),
    sa.Column('tool_call', JSON, nullable=True),
    sa.Column('observation', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('generation_s', sa.Float(), nullable=True),
    sa.Column('tool_s', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_turns_episode_id_episodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_turns')),
    sa.UniqueConstraint('episode_id', 'idx', name=op.f('uq_turns_episode_id_idx'))
    )


def downgrade() -> None:
    op.drop_table('turns')
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_episodes_run_id_task_id'))
        batch_op.drop_index(batch_op.f('ix_episodes_run_id_status'))
        batch_op.drop_index(batch_op.f('ix_episodes_run_id_finished_at'))

    op.drop_table('episodes')
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_groups_status_ready_at'))
        batch_op.drop_index(batch_op.f('ix_groups_claim_id'))

    op.drop_table('groups')
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tasks_suite_id_repo'))
        batch_op.drop_index(batch_op.f('ix_tasks_suite_id_position'))

    op.drop_table('tasks')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_suite_id'))
        batch_op.drop_index(batch_op.f('ix_runs_status'))

    op.drop_table('runs')
    with op.batch_alter_table('suites', schema=None) as batch_op:
        batch_op.drop_index('uq_suites_live_name', postgresql_where=sa.text('deleted_at IS NULL'), sqlite_where=sa.text('deleted_at IS NULL'))

    op.drop_table('suites')
    op.drop_table('policies')

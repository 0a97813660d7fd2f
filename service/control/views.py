"""What the API and the web UI show of runs, episodes, turns and policies: the aggregation
queries and the shapes, in one place, so a page and a REST answer always agree. Each view
takes what the caller may see (`Answers`) and redacts before it returns."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from service.control.evaluation import eval_results
from service.control.redaction import Answers, is_oracle
from service.control.training import ending_version
from service.store.buffer import LEFT_AT_END
from service.store.records import decode_array
from service.store.status import EPISODE_FINAL
from service.store.tables import Episode, Group, Policy, Run, Task, Turn

Arrays = Literal["none", "base64", "json"]


class NotFound(LookupError):
    """No such run, episode or turn; the message names it."""


async def get_run(session: AsyncSession, run_id: uuid.UUID) -> Run:
    run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run


async def progress(session: AsyncSession, run: Run, answers: Answers) -> dict:
    """A run's counts by status, reward mean, pass@1 / pass@k over tasks, tokens, throughput,
    and why it failed (host paths withheld without the token)."""
    return (await progress_many(session, [run], answers))[0]


async def progress_many(session: AsyncSession, runs: list[Run], answers: Answers) -> list[dict]:
    """progress() of many runs in three queries (the runs page lists hundreds)."""
    ids = [r.id for r in runs]
    if not ids:
        return []
    counts: dict[uuid.UUID, dict[str, int]] = {i: {} for i in ids}
    for run_id, status, n in (await session.execute(
            sa.select(Episode.run_id, Episode.status, sa.func.count()).where(Episode.run_id.in_(ids))
            .group_by(Episode.run_id, Episode.status))).all():
        counts[run_id][status] = n
    aggs = {row[0]: row[1:] for row in (await session.execute(sa.select(
        Episode.run_id, sa.func.avg(Episode.reward), sa.func.count(Episode.reward),
        sa.func.coalesce(sa.func.sum(Episode.input_tokens + Episode.output_tokens), 0),
        sa.func.min(Episode.started_at), sa.func.max(Episode.finished_at),
        sa.func.count(Episode.guards),
    ).where(Episode.run_id.in_(ids)).group_by(Episode.run_id))).all()}
    by_task: dict[uuid.UUID, list[tuple]] = {i: [] for i in ids}
    for run_id, best, mean in (await session.execute(
            sa.select(Episode.run_id, sa.func.max(Episode.reward), sa.func.avg(Episode.reward))
            .where(Episode.run_id.in_(ids), Episode.reward.is_not(None))
            .group_by(Episode.run_id, Episode.task_id))).all():
        by_task[run_id].append((best, mean))
    out = []
    for run in runs:
        reward, graded, tokens, start, end, guarded = aggs.get(run.id, (None, 0, 0, None, None, 0))
        elapsed = (end - start).total_seconds() if start and end else None
        tasks, c = by_task[run.id], counts[run.id]
        final = sum(n for st, n in c.items() if st in EPISODE_FINAL)
        out.append({
            "id": run.id, "name": run.name, "status": run.status, "suite_id": run.suite_id,
            "created_at": run.created_at, "finished_at": run.finished_at, "episodes": c, "final": final,
            "reward_mean": reward, "graded": graded, "tokens": tokens,
            "pass_at_1": sum(t[1] for t in tasks) / len(tasks) if tasks else None,
            "pass_at_k": sum(1 for t in tasks if t[0] == 1.0) / len(tasks) if tasks else None,
            "tokens_per_s": tokens / elapsed if elapsed else None,
            "episodes_per_s": final / elapsed if elapsed else None,
            "gate": run.gate, "owner": run.owner, "guarded": guarded, "error": answers.error(run.error),
            "kind": run.kind, "parent_id": run.parent_id, "policy_version": run.policy_version,
        })  # fmt: skip
    return out


async def list_runs(session: AsyncSession, limit: int, offset: int, answers: Answers) -> dict:
    total = await session.scalar(sa.select(sa.func.count()).select_from(Run))
    runs = (await session.scalars(sa.select(Run).order_by(Run.created_at.desc()).limit(limit).offset(offset))).all()
    return {"items": await progress_many(session, list(runs), answers), "total": total, "limit": limit, "offset": offset}


def episode_summary(e: Episode, instance_id: str) -> dict:
    """An episode's row as a list item or an event shows it (unredacted)."""
    return {
        "id": e.id, "run_id": e.run_id, "group_id": e.group_id, "task_id": e.task_id, "instance_id": instance_id,
        "sample_index": e.sample_index, "status": e.status, "attempt": e.attempt, "trainable": e.trainable,
        "reward": e.reward, "policy_version_min": e.policy_version_min, "policy_version_max": e.policy_version_max,
        "n_turns": e.n_turns, "input_tokens": e.input_tokens, "output_tokens": e.output_tokens,
        "error_type": e.error_type, "error_message": e.error_message, "started_at": e.started_at,
        "finished_at": e.finished_at, "guards": e.guards,
    }  # fmt: skip


async def list_episodes(session: AsyncSession, answers: Answers, run_id: uuid.UUID, *, status: str | None = None,
                        task: str | None = None, min_reward: float | None = None,
                        policy_version: int | None = None, limit: int = 100, offset: int = 0) -> dict:
    oracle = is_oracle((await get_run(session, run_id)).config)
    where = [Episode.run_id == run_id]
    if status is not None:
        where.append(Episode.status == status)
    if task is not None:
        where.append(Task.instance_id == task)
    if min_reward is not None:
        where.append(Episode.reward >= min_reward)
    if policy_version is not None:
        where += [Episode.policy_version_min <= policy_version, Episode.policy_version_max >= policy_version]
    base = sa.select(Episode, Task.instance_id).join(Task, Task.id == Episode.task_id).where(*where)
    total = await session.scalar(sa.select(sa.func.count()).select_from(base.subquery()))
    rows = (await session.execute(base.order_by(Episode.created_at, Episode.sample_index).limit(limit).offset(offset))).all()
    return {"items": [answers.episode(episode_summary(e, instance_id), oracle=oracle) for e, instance_id in rows],
            "total": total, "limit": limit, "offset": offset}


def _array(blob: bytes | None, arrays: Arrays):
    if blob is None:
        return None
    if arrays == "base64":
        return base64.b64encode(blob).decode()
    return decode_array(blob).tolist()


def turn_view(t: Turn, arrays: Arrays) -> dict:
    item = {"idx": t.idx, "segment": t.segment, "policy_version": t.policy_version, "finish_reason": t.finish_reason,
            "text": t.text, "tool_call": t.tool_call, "observation": t.observation,
            "n_input_tokens": t.n_input_tokens, "n_output_tokens": t.n_output_tokens,
            "generation_s": t.generation_s, "tool_s": t.tool_s}
    if arrays != "none":
        item |= {k: _array(getattr(t, k), arrays) for k in ("input_ids", "output_ids", "output_logprobs", "routed_experts")}
    return item


async def episode_detail(session: AsyncSession, answers: Answers, episode_id: uuid.UUID, *, arrays: Arrays = "none",
                         turns_offset: int = 0, turns_limit: int | None = None) -> dict:
    """An episode with its report, diff and turns, as this caller may see them."""
    row = (await session.execute(sa.select(Episode, Task.instance_id, Run.config)
                                 .join(Task, Task.id == Episode.task_id).join(Run, Run.id == Episode.run_id)
                                 .where(Episode.id == episode_id))).first()
    if row is None:
        raise NotFound(f"episode {episode_id} not found")
    episode, instance_id, config = row
    query = sa.select(Turn).where(Turn.episode_id == episode_id, Turn.idx >= turns_offset).order_by(Turn.idx)
    turns = (await session.scalars(query.limit(turns_limit) if turns_limit else query)).all()
    out = episode_summary(episode, instance_id) | {"report": episode.report, "diff": episode.diff,
                                                  "segment_starts": episode.segment_starts,
                                                  "turns": [turn_view(t, arrays) for t in turns]}
    return answers.episode(out, oracle=is_oracle(config))


TOKENIZER_WAIT_S = 10.0


class TokenizerUnavailable(RuntimeError):
    """The run's tokenizer folder cannot be loaded here; the message names it."""


async def turn_tokens(session: AsyncSession, answers: Answers, episode_id: uuid.UUID, turn: int) -> dict:
    """A turn's sampled tokens, each decoded alone with the run's tokenizer, with its logprob."""
    from service.fleet.client import load_tokenizer

    row = (await session.execute(sa.select(Turn.output_ids, Turn.output_logprobs, Run.config)
                                 .join(Episode, Episode.id == Turn.episode_id).join(Run, Run.id == Episode.run_id)
                                 .where(Turn.episode_id == episode_id, Turn.idx == turn))).first()
    if row is None:
        raise NotFound(f"episode {episode_id} has no turn {turn}")
    if answers.hides_turns(is_oracle(row.config)):
        return {"turn": turn, "tokens": [], "redacted": ["tokens"]}
    tokenizer_dir = (row.config.get("sampler") or {}).get("tokenizer")
    try:  # not queued behind another load for long: a 409 the viewer tries again
        tok = await asyncio.to_thread(load_tokenizer, str(tokenizer_dir), TOKENIZER_WAIT_S)
    except TimeoutError as e:
        raise TokenizerUnavailable(answers.error(f"the run's tokenizer is not loaded yet: {e}; try again")) from e
    except Exception as e:  # noqa: BLE001 - any loading failure: say which folder
        raise TokenizerUnavailable(answers.error(f"the run's tokenizer {tokenizer_dir} cannot be loaded: "
                                                 f"{type(e).__name__}")) from e
    ids = decode_array(row.output_ids).tolist()
    logprobs = decode_array(row.output_logprobs).tolist() if row.output_logprobs else [None] * len(ids)
    return {"turn": turn, "tokens": [{"id": i, "text": tok.decode([i], skip_special_tokens=False), "logprob": lp}
                                     for i, lp in zip(ids, logprobs)], "redacted": []}


async def run_events(session: AsyncSession, answers: Answers, run_id: uuid.UUID, oracle: bool,
                     seen: dict[uuid.UUID, tuple]) -> tuple[dict, list[dict]]:
    """The run's progress and the episodes that changed since `seen` (updated in place)."""
    state = await progress(session, await get_run(session, run_id), answers)
    rows = (await session.execute(sa.select(Episode, Task.instance_id).join(Task, Task.id == Episode.task_id)
                                  .where(Episode.run_id == run_id))).all()
    changed = []
    for episode, instance_id in rows:
        key = (episode.status, episode.n_turns, episode.reward)
        if seen.get(episode.id) != key:
            seen[episode.id] = key
            changed.append(answers.episode(episode_summary(episode, instance_id), oracle=oracle))
    return state, changed


async def list_policies(session: AsyncSession, limit: int, offset: int) -> dict:
    """The published versions, newest first, each with the metrics of the step that made it and
    the evaluations made of it (after it was published)."""
    total = await session.scalar(sa.select(sa.func.count()).select_from(Policy))
    rows = (await session.scalars(sa.select(Policy).order_by(Policy.version.desc()).limit(limit).offset(offset))).all()
    evals = await evaluations(session, sa.and_(Run.kind == "eval", Run.policy_version.in_([p.version for p in rows])))
    return {"items": [{"version": p.version, "trainer_step": p.trainer_step, "weights_path": p.weights_path,
                       "created_at": p.created_at, "metrics": p.info or {},
                       "evals": [e for e in evals if e["policy_version"] == p.version and e["created_at"] >= p.created_at]}
                      for p in rows],
            "total": total, "limit": limit, "offset": offset}


async def evaluations(session: AsyncSession, where) -> list[dict]:
    """Evaluation runs matching `where`, oldest first, with what they measured."""
    runs = (await session.scalars(sa.select(Run).where(where).order_by(Run.created_at))).all()
    results = await eval_results(session, {r.id: int(r.config.get("samples_per_task", 1)) for r in runs})
    return [{"run_id": r.id, "parent_id": r.parent_id, "policy_version": r.policy_version, "status": r.status,
             "suite_id": r.suite_id, "created_at": r.created_at, "finished_at": r.finished_at, **results[r.id]}
            for r in runs]


STEP_METRICS = ("loss", "reward_mean", "mismatch_kl", "entropy", "nll", "masked_fraction", "grad_norm", "groups",
                "zero_advantage_groups", "dropped_groups", "episodes", "sampled_tokens", "staleness_mean",
                "staleness_max", "wait_s", "step_s", "publish_s", "tokens_per_s")


async def training(session: AsyncSession, run: Run) -> dict | None:
    """A training run's steps (the metrics of each version its trainer published, the groups
    the filter skipped and the share of groups that taught something), its evaluations, its
    groups by status, and its pace. None for other runs."""
    if run.kind != "train":
        return None
    cfg = run.config.get("training") or {}
    policies = (await session.execute(sa.select(Policy.version, Policy.created_at, Policy.info)
                                      .order_by(Policy.version))).all()
    skipped = dict((await session.execute(sa.select(Group.min_policy_version, sa.func.count()).where(
        Group.run_id == run.id, Group.status == "skipped").group_by(Group.min_policy_version))).all())
    steps = []
    for version, created, info in policies:
        info = info or {}
        if version == 0 or info.get("run_id") != str(run.id):
            continue
        groups, useless = info.get("groups") or 0, info.get("zero_advantage_groups") or 0
        steps.append({"version": version, "created_at": created, **{k: info.get(k) for k in STEP_METRICS},
                      "useful_fraction": (groups - useless) / groups if groups else None,
                      "filtered": skipped.get(version - 1, 0)})
    started = next((created for version, created, _ in policies if version == 0), None)
    hours = (steps[-1]["created_at"] - started).total_seconds() / 3600 if steps and started else None
    groups = dict((await session.execute(sa.select(Group.status, sa.func.count()).where(Group.run_id == run.id)
                                         .group_by(Group.status))).all())
    left = await session.scalar(sa.select(sa.func.count()).select_from(Group).where(
        Group.run_id == run.id, Group.status == "dropped", Group.dropped_reason.like(LEFT_AT_END.format("%"))))
    epoch = await session.scalar(sa.select(sa.func.max(Group.epoch)).where(Group.run_id == run.id))
    return {"step": steps[-1]["version"] if steps else 0, "last_step": ending_version(cfg.get("steps"), run.last_version),
            "stopped_early": run.last_version is not None, "epoch": epoch,
            "epochs": cfg.get("epochs"), "exhausted": run.exhausted_at is not None, "groups": groups,
            "filtered": groups.get("skipped", 0), "dropped": groups.get("dropped", 0) - left,
            "left_at_end": left,
            "steps_per_hour": len(steps) / hours if hours else None, "steps": steps,
            "evals": await evaluations(session, sa.and_(Run.parent_id == run.id, Run.kind == "eval"))}


async def task_difficulty(session: AsyncSession, run_id: uuid.UUID, limit: int = 500) -> dict:
    """Per task of a run: the solved fraction of its graded samples in each epoch (None: not
    sampled or not graded), and how often the filter skipped it."""
    solved = sa.func.sum(sa.case((Episode.reward >= 1.0, 1), else_=0))
    rows = (await session.execute(
        sa.select(Task.instance_id, Group.epoch, sa.func.count(Episode.reward), solved)
        .join(Group, Group.task_id == Task.id).join(Episode, Episode.group_id == Group.id, isouter=True)
        .where(Group.run_id == run_id).group_by(Task.instance_id, Group.epoch))).all()
    skips = dict((await session.execute(sa.select(Task.instance_id, sa.func.count()).join(Group, Group.task_id == Task.id)
                                        .where(Group.run_id == run_id, Group.status == "skipped")
                                        .group_by(Task.instance_id))).all())
    epochs = max((r[1] for r in rows), default=-1) + 1
    tasks: dict[str, list] = {}
    for instance_id, epoch, graded, n_solved in rows:
        tasks.setdefault(instance_id, [None] * epochs)[epoch] = (n_solved or 0) / graded if graded else None
    items = [{"instance_id": k, "pass_rate": v, "skipped": skips.get(k, 0)} for k, v in sorted(tasks.items())]
    return {"epochs": epochs, "tasks": items[:limit], "total": len(items)}


async def group_detail(session: AsyncSession, answers: Answers, group_id: uuid.UUID) -> dict:
    """A group's samples side by side: each episode's status, reward and advantage (reward minus
    the mean of the group's rewarded samples, and that over their standard deviation), turns,
    tokens and diff, as this caller may see them."""
    row = (await session.execute(sa.select(Group, Task.instance_id, Run.config).join(Task, Task.id == Group.task_id)
                                 .join(Run, Run.id == Group.run_id).where(Group.id == group_id))).first()
    if row is None:
        raise NotFound(f"group {group_id} not found")
    group, instance_id, config = row
    episodes = (await session.scalars(sa.select(Episode).where(Episode.group_id == group_id)
                                      .order_by(Episode.sample_index))).all()
    rewards = [e.reward for e in episodes if e.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else None
    oracle = is_oracle(config)
    items = []
    for e in episodes:
        adv = None if e.reward is None or mean is None else e.reward - mean
        item = episode_summary(e, instance_id) | {
            "diff": e.diff, "advantage": adv,
            "advantage_std_normalized": None if adv is None else adv / (std + 1e-6)}
        items.append(answers.episode(item, oracle=oracle))
    return {"id": group.id, "run_id": group.run_id, "task_id": group.task_id, "instance_id": instance_id,
            "seq": group.seq, "epoch": group.epoch, "status": group.status, "size": group.size,
            "min_policy_version": group.min_policy_version, "trainer_step": group.trainer_step,
            "skipped_reason": group.dropped_reason if group.status == "skipped" else None,
            "dropped_reason": group.dropped_reason if group.status == "dropped" else None,
            "reward_mean": mean, "reward_std": std, "teaches": bool(std and std > 1e-6), "episodes": items}

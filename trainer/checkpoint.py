"""Checkpoints of model and optimizer (torch.distributed.checkpoint, each rank writing its own
shards; one counts once its COMPLETE marker is written) and the buffer's side of resuming from
one: the steps after it never happened, so their groups go back and their versions are withdrawn."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from service.store.buffer import Buffer
from trainer.config import TrainerConfig
from trainer.parallel import Ranks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


@dataclass(frozen=True)
class Republish:
    """What rank 0 found on resuming at a step after 0, for every rank: the trainer died between
    that step's checkpoint and its publication, so it publishes again (`record`: the version is
    not in the database), or writes only its weights for the fleet to load (`write`)."""

    record: bool = False
    write: bool = False


def checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The complete checkpoints, oldest first."""
    root = run_dir / "checkpoints"
    found = []
    for d in root.glob("step-*") if root.exists() else []:
        if (d / "COMPLETE").exists():
            found.append(Checkpoint(int(d.name.removeprefix("step-")), d))
    return sorted(found, key=lambda c: c.step)


def save(model, optimizer, run_dir: Path, step: int, ranks: Ranks, keep: int) -> Path:
    """Every rank's shards of the plain module and optimizer state dicts: torchtitan's fused QKV
    renames its keys in state_dict hooks, so get_state_dict's would not load back. The oldest
    checkpoints beyond `keep` are removed."""
    import torch.distributed.checkpoint as dcp

    path = run_dir / "checkpoints" / f"step-{step}"
    if ranks.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    ranks.barrier()
    _materialize_optimizer_state(model, optimizer, only_missing=True)  # what load expects to find
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(path))
    ranks.barrier()
    if ranks.rank == 0:
        (path / "COMPLETE").write_text(json.dumps({"step": step, "ranks": ranks.world}))  # last: a torn save is ignored
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
    ranks.barrier()
    return path


def load(model, optimizer, checkpoint: Checkpoint) -> None:
    import torch.distributed.checkpoint as dcp

    _materialize_optimizer_state(model, optimizer)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint.path))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])


def _materialize_optimizer_state(model, optimizer, only_missing: bool = False) -> None:
    """A step with zero gradients and zero learning rate: the optimizer's state tensors exist
    (with their shapes) for the checkpoint to be loaded into, and no weight moves. With
    `only_missing`, only for parameters that have none yet (steps without data, experts no
    token reached), the others' state untouched: a checkpoint always holds every parameter's."""
    params = [p for p in model.parameters() if not (only_missing and optimizer.state.get(p))]
    if not params:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in model.parameters():
        p.grad = None
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


async def rewind(buffer: Buffer, cfg: TrainerConfig, step: int, weights: Path) -> Republish:
    """Rank 0: the buffer back to `step` (groups consumed later and the claims this trainer held
    when it died go back, later versions are withdrawn), version 0 recorded if it is not yet;
    `weights` is where the step's published weights belong."""
    back, withdrawn = await buffer.rewind(step, cfg.run_id)
    unclaimed = await buffer.release_owner(cfg.name, cfg.run_id)
    if back or withdrawn or unclaimed:
        logger.warning("resumed at step %d: %d consumed and %d claimed group(s) back to the buffer, "
                       "%d policy version(s) withdrawn", step, back, unclaimed, withdrawn)
    if step == 0:
        await buffer.record_policy(0, str(cfg.model.resolve()), 0, if_absent=True)
        return Republish()
    return Republish(record=not await buffer.has_policy(step), write=bool(cfg.endpoints) and not weights.exists())

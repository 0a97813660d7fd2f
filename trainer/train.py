"""The asynchronous RL trainer: claims ready groups from the buffer, trains one step on them,
commits the claim with the step, checkpoints, publishes the new policy, repeats.

The trainer owns the version counter: after step s it publishes version s+1. It meets the
inference fleet only there; rollouts keep running while it trains.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from sqlalchemy.ext.asyncio import AsyncEngine

from service.store.buffer import Buffer, Claim, ClaimLost, GroupData
from service.store.status import RUN_ACTIVE
from trainer import checkpoint
from trainer.config import TrainerConfig
from trainer.data import BatchStats, Row, group_advantages_of, pack, packing_efficiency, sequences_from_groups
from trainer.loss import policy_loss
from trainer.model import (
    apply_activation_checkpointing,
    apply_float8,
    build_model,
    forward_logprobs,
    packs_documents,
    set_expert_dtype,
)
from trainer.parallel import Ranks, Unit, init_distributed, micro_batches, parallelize, projection_rounds
from trainer.publish import announce, serve, weights_dir, write_weights
from trainer.replay import enable

logger = logging.getLogger(__name__)
ROW_FIELDS = ("inputs", "targets", "positions", "loss_mask", "inf_logprobs", "advantages", "seq_ids")


@dataclass
class Batch:
    """One step's data, packed."""

    rows: list[Row]
    stats: BatchStats
    truncated: int
    n_tokens: int
    n_seqs: int
    norm_tokens: int
    """The loss's denominator (LossConfig.normalize "batch": every token the groups sampled;
    else n_tokens)."""


@dataclass
class Handout:
    """What rank 0 hands every rank at the start of a step: the batch and what its claim
    counted, or why rank 0 stopped (then every rank stops)."""

    batch: Batch | None = None
    dropped_groups: int = 0
    zero_advantage_groups: int = 0
    staleness: list[int] = field(default_factory=list)
    error: str | None = None
    done: bool = False
    """The run makes no more groups: every rank stops (error says why)."""

    def metrics(self, step: int) -> dict:
        return {"step": step, "dropped_groups": self.dropped_groups,
                "zero_advantage_groups": self.zero_advantage_groups,
                "staleness_mean": float(np.mean(self.staleness)) if self.staleness else None,
                "staleness_max": max(self.staleness) if self.staleness else None}


class ScheduleDone(Exception):
    """The trainer's run makes no more groups to train on."""


class Trainer:
    """The training loop. Under torchrun (WORLD_SIZE > 1) every process runs it: the model is
    sharded over the processes (FSDP2, expert parallelism), rank 0 alone talks to the database
    and the fleet, hands every rank the same packed batch, and each rank trains on its share
    of the batch's micro-batches."""

    def __init__(self, cfg: TrainerConfig, engine: AsyncEngine | None = None):
        """engine None on rank 0: the model, optimizer and step alone (benchmarks, the golden
        test); the loop (`run`) needs the database there."""
        self.cfg, self.step = cfg, 0
        self.buffer = Buffer(engine) if engine is not None else None
        self._dataset: list[GroupData] | None = None
        self.dir = cfg.out_dir / cfg.name
        self.ranks = Ranks.joined(cfg)
        self.device = self.ranks.device
        par = cfg.parallelism
        torch.manual_seed(cfg.seed)
        self.model, model_cfg, self.adapter = build_model(cfg.model, cfg.attn_backend, par.torch_dtype(), self.device)
        self.model.train()
        set_expert_dtype(self.model, cfg.expert_dtype)
        self.moe_layers = enable(self.model)
        if par.float8:
            apply_float8(self.model)
        apply_activation_checkpointing(self.model, par.activation_checkpoint)
        if self.ranks.world > 1:
            parallelize(self.model, model_cfg, world_size=self.ranks.world, fsdp=par.data_parallel_shard_degree,
                        ep=par.expert_parallel_degree, device_type=self.device.type)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                           weight_decay=cfg.optim.weight_decay)
        if engine is not None and self.ranks.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.json").write_text(cfg.model_dump_json(indent=2))

    async def run(self) -> list[dict]:
        """`steps` steps (0: until stopped), after resuming from the last checkpoint."""
        if self.ranks.rank == 0 and self.buffer is None:
            raise ValueError("Trainer.run needs a database engine")
        await self.resume()
        history, started = [], time.monotonic()
        while self.cfg.steps == 0 or len(history) < self.cfg.steps:
            if self.cfg.until_step is not None and self.step >= self.cfg.until_step:
                break
            waited = time.perf_counter()
            try:
                await self.wait_for_evaluation()
                claims, handout = await self.hand_out()
            except ScheduleDone as e:
                logger.info("stopping at step %d: %s", self.step, e)
                break
            waited = time.perf_counter() - waited
            metrics = await asyncio.to_thread(self.train_batch, handout.batch)
            lost = self.ranks.share(await self.commit(claims) if self.ranks.rank == 0 else None)
            if lost is not None:
                logger.warning("step %d discarded: %s", self.step, lost)
                self.optimizer.zero_grad(set_to_none=True)
                continue
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.optim.lr_at(self.step)
            self.optimizer.step()
            metrics["lr"] = self.cfg.optim.lr_at(self.step)
            self.step += 1
            if self.step % self.cfg.checkpoint_every == 0:
                await asyncio.to_thread(self.save_checkpoint)
            metrics |= handout.metrics(self.step) | {"wait_s": waited, "run_id": self.cfg.run_id and str(self.cfg.run_id)}
            published = time.perf_counter()
            metrics["reloaded"] = await self.publish(self.step, metrics)
            metrics["publish_s"] = time.perf_counter() - published
            if self.ranks.rank == 0:
                await self.buffer.annotate_policy(self.step, {"publish_s": metrics["publish_s"]})
            if self.ranks.rank == 0:
                self._record(metrics)
            history.append(metrics)
            if self.cfg.time_limit_s is not None and time.monotonic() - started >= self.cfg.time_limit_s:
                logger.info("stopping at step %d: time_limit_s (%s s) reached", self.step, self.cfg.time_limit_s)
                if self.ranks.rank == 0 and self.cfg.run_id is not None and self.cfg.dataset is None:
                    await self.buffer.end_training(self.cfg.run_id, self.step)  # its last version: the run ends
                break
        return history

    # ---- rank 0 and the buffer ---------------------------------------------------------------------

    async def wait_for_evaluation(self) -> None:
        """With `evaluate_every`, before training on version `step` when it is due an
        evaluation: wait until that evaluation ended, so that it sampled only this version."""
        every = self.cfg.evaluate_every
        if not every or self.step % every or self.cfg.run_id is None:
            return
        if self.ranks.rank == 0:
            deadline = time.monotonic() + self.cfg.wait_s
            while (status := await self.buffer.evaluation(self.cfg.run_id, self.step)) in (None, *RUN_ACTIVE):
                if await self.buffer.schedule_done(self.cfg.run_id) and status is None:
                    break  # the run ended: no evaluation is coming
                if time.monotonic() > deadline:
                    logger.warning("version %d: its evaluation did not end within %s s; training on", self.step,
                                   self.cfg.wait_s)
                    break
                await asyncio.sleep(1.0)
        self.ranks.barrier()

    async def hand_out(self) -> tuple[list[Claim], Handout]:
        """Rank 0 claims and packs the step's groups and hands every rank the batch; the claims
        stay on rank 0."""
        if self.ranks.rank != 0:
            handout = self.ranks.share(None)
            if handout.done:
                raise ScheduleDone(handout.error)
            if handout.error is not None:
                raise RuntimeError(f"rank 0 stopped: {handout.error}")
            return [], handout
        try:
            if self.cfg.dataset is not None:
                claims, groups, dropped, useless = [], await self.dataset_groups(), 0, 0
            else:
                claims, groups, dropped, useless = await self.claim()
        except ScheduleDone as e:
            self.ranks.share(Handout(error=f"{ScheduleDone.__name__}: {e}", done=True))
            raise
        try:
            staleness = [] if self.cfg.dataset is not None else [  # a dataset is off-policy by design
                self.step - g.episodes[0].policy_version_min for g in groups
                if g.episodes and g.episodes[0].policy_version_min is not None]
            handout = Handout(self.prepare(groups), dropped, useless, staleness)
        except Exception as e:
            self.ranks.share(Handout(error=f"{type(e).__name__}: {e}"))  # the other ranks stop too
            raise
        return claims, self.ranks.share(handout)

    async def claim(self) -> tuple[list[Claim], list[GroupData], int, int]:
        """Claims holding groups_per_step useful groups (of the run, if set; with fill_useful
        off, groups_per_step groups, useful or not), every group claimed, and the counts of
        stale groups dropped and of useless ones. Groups that teach nothing (all advantages
        zero, no rewarded episode) ride along in the claims: consumed with the step, counted in
        its reward and staleness, trained on by nothing (prepare leaves them out), never handed
        out again; with fill_useful they are consumed as soon as they are loaded."""
        deadline = time.monotonic() + self.cfg.wait_s
        claims, useful, dropped, useless, taken = [], [], 0, 0, []

        def missing() -> int:
            return self.cfg.groups_per_step - len(useful) - (0 if self.cfg.fill_useful else useless)

        while missing() > 0:
            claim = await self.buffer.claim(missing(), trainer_step=self.step,
                                            max_staleness=self.cfg.max_off_policy_steps, lease_s=self.cfg.lease_s,
                                            run_id=self.cfg.run_id, owner=self.cfg.name)
            dropped += claim.dropped
            if claim.group_ids:
                loaded, good, idle = await self.buffer.load(claim), [], []
                for group in loaded:
                    if group_advantages_of(group, self.cfg.data) is not None:
                        good.append(group)
                    else:
                        idle.append(group.id)
                if self.cfg.fill_useful and idle:
                    # consumed now, not held until the step: the orchestrator counts a claimed
                    # group as waiting to be trained on and starts none past
                    # (max_off_policy_steps + 1) x groups_per_step of them, so a step short of
                    # useful groups behind that many useless ones would wait for groups that
                    # never start
                    try:
                        claim = await self.buffer.consume(claim, idle, trainer_step=self.step + 1)
                    except ClaimLost as e:
                        logger.warning("step %d: %s; claiming others", self.step + 1, e)
                        await self.buffer.release(claim)
                        continue
                taken += loaded
                useful += good
                useless += len(idle)
                if claim.group_ids:
                    claims.append(claim)
                continue
            if self.cfg.run_id is not None and await self.buffer.schedule_done(self.cfg.run_id):
                if useful or (useless and not self.cfg.fill_useful):  # the schedule's last groups: a smaller step
                    break
                for c in claims:
                    await self.buffer.commit(c, trainer_step=self.step + 1)  # taught nothing: consumed
                raise ScheduleDone(f"run {self.cfg.run_id} makes no more groups (its schedule is done or it ended)")
            if time.monotonic() > deadline:
                for c in claims:
                    await self.buffer.release(c)
                raise TimeoutError(f"no {self.cfg.groups_per_step} useful ready groups within {self.cfg.wait_s} s")
            await asyncio.sleep(1.0)
        return claims, taken, dropped, useless

    async def dataset_groups(self) -> list[GroupData]:
        """The step's groups of the fixed dataset (cfg.dataset): the next groups_per_step of an
        order shuffled per epoch with the seed, so a resumed trainer takes up where the step
        count says, and nothing is claimed."""
        if self._dataset is None:
            ids = await self.buffer.trained_group_ids(self.cfg.dataset.run_id)
            self._dataset = await self.buffer.load_groups(ids)
            if not self._dataset:
                raise ScheduleDone(f"run {self.cfg.dataset.run_id} has no groups to train on (dataset.run_id)")
        per_epoch = -(-len(self._dataset) // self.cfg.groups_per_step)
        epoch, index = divmod(self.step, per_epoch)
        if self.cfg.dataset.epochs is not None and epoch >= self.cfg.dataset.epochs:
            raise ScheduleDone(f"dataset: {self.cfg.dataset.epochs} epoch(s) of {len(self._dataset)} group(s) done")
        order = list(self._dataset)
        random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        return order[index * self.cfg.groups_per_step:(index + 1) * self.cfg.groups_per_step]

    def prepare(self, groups: list[GroupData]) -> Batch:
        """Sequences of the groups' turns, packed into rows."""
        sequences, stats = sequences_from_groups(groups, self.cfg.data)
        rows, truncated = pack(sequences, self.cfg.data.seq_len)
        n_tokens = int(sum(r.loss_mask.sum() for r in rows))
        n_seqs = len({(i, sid) for i, r in enumerate(rows) for sid in set(r.seq_ids[r.loss_mask].tolist())})
        norm = max(stats.sampled_tokens, n_tokens) if self.cfg.loss.normalize == "batch" else n_tokens
        return Batch(rows, stats, truncated, n_tokens, n_seqs, norm)

    async def commit(self, claims: list[Claim]) -> str | None:
        """The claims consumed by the step that makes version step+1; if a lease ran out, why
        (its groups went back: the step must not be applied)."""
        try:
            for claim in claims:
                await self.buffer.commit(claim, trainer_step=self.step + 1)
        except ClaimLost as e:
            return str(e)
        return None

    def _record(self, metrics: dict) -> None:
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        logger.info("step %d: %s", self.step, {k: metrics[k] for k in ("loss", "reward_mean", "mismatch_kl")})

    # ---- every rank: the step ----------------------------------------------------------------------

    def train_batch(self, batch: Batch) -> dict:
        """Forward and backward of this rank's share of the batch (gradients accumulate; the
        loss is normalised by the whole batch), metrics summed over the ranks, gradients clipped."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(5, dtype=torch.float64)  # loss, and mismatch KL, masked fraction, entropy, NLL token-weighted
        started = time.perf_counter()
        shares = micro_batches(batch.rows, self.ranks.world, split_documents=not packs_documents(self.model))
        for unit, pieces in zip(shares[self.ranks.rank], projection_rounds(shares, self.cfg.logprob_chunk)):
            if unit is None:
                self._idle_pass(pieces)
            else:
                sums += self._backward(batch, unit, pieces)
        if self.ranks.world > 1:
            dist.all_reduce(sums)
        grad_norm = self._clip_gradients()
        return _step_metrics(batch, sums.tolist(), grad_norm, time.perf_counter() - started, self.ranks.world)

    def _backward(self, batch: Batch, unit: Unit, pieces: int | None) -> torch.Tensor:
        """One micro-batch's loss backpropagated; its loss and token-weighted metrics."""
        cfg = self.cfg
        i, s, e = unit
        row = batch.rows[i]
        t = {k: torch.from_numpy(np.ascontiguousarray(getattr(row, k)[s:e])).to(self.device) for k in ROW_FIELDS}
        experts = None
        if cfg.router_replay and self.moe_layers and row.routed_experts is not None:
            experts = torch.from_numpy(np.ascontiguousarray(row.routed_experts[s:e])).to(self.device)
        logp, entropy = forward_logprobs(self.model, t["inputs"], t["positions"], t["seq_ids"], t["targets"],
                                         experts, chunk=cfg.logprob_chunk, pieces=pieces,
                                         entropy_at=t["loss_mask"].bool())
        # SFT: no sampler to correct for (scripted "samples" carry logprob 0): ratio 1, plain NLL
        inf = logp.detach() if cfg.sft else t["inf_logprobs"]
        out = policy_loss(logp, inf, t["advantages"], t["loss_mask"], cfg.loss, t["seq_ids"],
                          total_tokens=batch.norm_tokens, total_sequences=batch.n_seqs)
        out.loss.backward()
        weight = out.metrics["sampled_tokens"] / max(batch.n_tokens, 1)
        sampled = t["loss_mask"]
        mean_entropy, nll = ((float(entropy[sampled].mean()), float(-logp.detach()[sampled].mean()))
                             if bool(sampled.any()) else (0.0, 0.0))
        return torch.tensor([out.loss.item(), out.metrics["mismatch_kl"] * weight,
                             out.metrics["masked_fraction"] * weight, mean_entropy * weight, nll * weight],
                            dtype=torch.float64)

    def _idle_pass(self, pieces: int | None) -> None:
        """A one-token forward and backward with zero loss: joins the collectives of a round."""
        x = torch.zeros(1, dtype=torch.long, device=self.device)
        logp, _ = forward_logprobs(self.model, x, x, x, x, pieces=pieces)
        (logp.sum() * 0.0).backward()

    def _clip_gradients(self) -> float | None:
        """The gradients' global norm (over every rank's shards, expert and non-expert meshes
        alike), clipped to optim.grad_clip; None without clipping."""
        if self.cfg.optim.grad_clip is None:
            return None
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.ranks.world > 1:
            from torchtitan.distributed.utils import clip_grad_norm_

            norm = clip_grad_norm_(params, self.cfg.optim.grad_clip,
                                   ep_enabled=self.cfg.parallelism.expert_parallel_degree > 1)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # ---- every rank: checkpoints and publication ---------------------------------------------------

    def save_checkpoint(self) -> Path:
        return checkpoint.save(self.model, self.optimizer, self.dir, self.step, self.ranks, self.cfg.keep_checkpoints)

    async def resume(self) -> None:
        """Back to the last checkpoint (or the initial weights): later steps never happened."""
        found = self.ranks.share(checkpoint.checkpoints(self.dir))  # rank 0's view: the ranks load the same one
        self.step = found[-1].step if found else 0
        if found:
            await asyncio.to_thread(checkpoint.load, self.model, self.optimizer, found[-1])
        weights = weights_dir(self.dir, self.step)
        todo = self.ranks.share(await checkpoint.rewind(self.buffer, self.cfg, self.step, weights)
                                if self.ranks.rank == 0 else None)
        if todo.record:
            await self.publish(self.step, {"republished": True})
        elif todo.write:
            await asyncio.to_thread(write_weights, self.model, self.adapter, self.cfg, weights, self.ranks.rank)
        if self.cfg.endpoints and self.ranks.rank == 0:  # the fleet serves this trainer's weights before anything else
            await serve(self.cfg, weights if self.step else self.cfg.model, self.step, force=bool(found))
        self.ranks.barrier()

    async def publish(self, version: int, metrics: dict) -> list[str]:
        """The weights gathered and written (every rank); on rank 0, the version recorded and
        the fleet reloaded. Returns the servers that reloaded."""
        out = weights_dir(self.dir, version)
        path = await asyncio.to_thread(write_weights, self.model, self.adapter, self.cfg, out, self.ranks.rank)
        if self.ranks.rank != 0:
            return []
        return await announce(self.buffer, self.cfg, version, path, self.step, metrics)


def _step_metrics(batch: Batch, sums: list[float], grad_norm: float | None, elapsed: float, world: int) -> dict:
    stats, rows = batch.stats, batch.rows
    used = sum(r.used for r in rows)
    loss, kl, masked, entropy, nll = sums
    return {
        "loss": loss, "mismatch_kl": kl, "masked_fraction": masked, "entropy": entropy, "nll": nll,
        "reward_mean": float(np.mean(stats.rewards)) if stats.rewards else None,
        "advantage_mean": float(np.mean(stats.advantages)) if stats.advantages else None,
        "advantage_std": float(np.std(stats.advantages)) if stats.advantages else None,
        "groups": stats.groups, "zero_advantage_groups": stats.zero_advantage_groups,
        "episodes": stats.episodes, "excluded_episodes": stats.excluded_episodes,
        "skipped_episodes": stats.skipped_episodes, "malformed_turns": stats.malformed_turns,
        "sampled_tokens": batch.n_tokens, "tokens": used, "truncated_tokens": batch.truncated,
        "packing_efficiency": packing_efficiency(rows), "grad_norm": grad_norm,
        "step_s": elapsed, "tokens_per_s": used / elapsed if elapsed else None, "ranks": world,
    }  # fmt: skip


async def train(cfg: TrainerConfig, database_url: str) -> list[dict]:
    """The loop in this process; under torchrun, this process's rank of it (rank 0 alone opens
    the database)."""
    from service.store.db import make_async_engine

    world = init_distributed(cfg)
    rank = dist.get_rank() if world > 1 else 0
    engine = make_async_engine(database_url) if rank == 0 else None
    try:
        trainer = await asyncio.to_thread(Trainer, cfg, engine)
        return await trainer.run()
    finally:
        if engine is not None:
            await engine.dispose()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()

"""The asynchronous RL trainer: claims ready groups from the buffer, trains one step on them,
commits the claim with the step, publishes the new policy (weights in the inference model's
layout, a policy version in the database, every inference server reloaded), repeats.

    swerve train --config trainer/configs/debug.toml [--steps=2 --loss.kl_coef=0.01 ...]

The trainer owns the version counter: after step s it publishes version s+1. It meets the
inference fleet only there; rollouts keep running while it trains.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import tomllib
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import numpy as np
import sqlalchemy as sa
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.data import (
    BatchStats,
    DataConfig,
    Row,
    pack,
    packing_efficiency,
    sequences_from_groups,
)
from trainer.loss import LossConfig, policy_loss
from trainer.model import forward_logprobs, packs_documents, projection_pieces

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0)


class ParallelismConfig(BaseModel):
    """How the model is laid out over `world_size` processes (torchtitan's parallelisms)."""

    model_config = ConfigDict(extra="forbid")
    world_size: int = Field(1, ge=1)
    data_parallel_shard_degree: int = Field(-1, ge=-1)
    """FSDP2 shards; -1: whatever world_size leaves after the other degrees."""
    tensor_parallel_degree: int = Field(1, ge=1)
    expert_parallel_degree: int = Field(1, ge=1)
    context_parallel_degree: int = Field(1, ge=1)
    """Splits each sequence across ranks: what 131k-token episodes need."""
    activation_checkpoint: Literal["none", "selective", "full"] = "none"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    float8: bool = False
    """float8 linears (torchao) where present."""

    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.param_dtype == "bfloat16" else torch.float32

    def fsdp(self) -> int:
        rest = self.tensor_parallel_degree * self.context_parallel_degree
        return self.data_parallel_shard_degree if self.data_parallel_shard_degree > 0 else self.world_size // rest


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "debug"
    model: Path
    """Hugging Face folder of the policy the fleet serves at version 0 (config, safetensors, tokenizer)."""
    out_dir: Path = Path("var/trainer")
    """Published weights (weights/v<N>), checkpoints and metrics.jsonl go under out_dir/name."""
    database_url: str | None = None
    """None: SWERVE_DATABASE_URL (or the embedded SQLite)."""
    endpoints: list[str] = []
    """vLLM servers to reload after every step (none: publish only)."""
    served_model: str | None = None
    run_id: uuid.UUID | None = None
    """Train only on this run's groups (None: any run's)."""
    steps: int = Field(1, ge=0)
    """Steps to train (0: until stopped)."""
    groups_per_step: int = Field(4, ge=1)
    max_off_policy_steps: int = Field(4, ge=0)
    """Claimed groups whose oldest token is more steps behind are dropped (and counted)."""
    lease_s: float = Field(600.0, gt=0)
    wait_s: float = Field(3600.0, gt=0)
    """Give up when no group becomes ready for this long."""
    attn_backend: str = "sdpa"
    """sdpa on CPU (documents run separately); flex or varlen on GPUs (packed documents)."""
    titan_flavor: str | None = None
    """A torchtitan registry model, "family:flavor" (e.g. "deepseek_v3:671B"), for real-size
    configs whose weights live on the cluster; None: built from `model`'s config.json."""
    parallelism: ParallelismConfig = ParallelismConfig()
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: the GPU of this process's local rank when there is one, else the CPU."""
    publish_shard_mb: int = Field(5000, ge=1)
    """Published weights are written in safetensors shards of at most this size."""
    logprob_chunk: int = Field(8192, ge=0)
    """Positions per vocabulary projection + log-softmax, recomputed in backward, so long rows
    never hold whole-row logits (0: whole rows)."""
    expert_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """dtype of the MoE experts' grouped matmuls: bfloat16 as torchtitan computes them, or
    float32 (slower; keeps a small model's trainer as exact as a float32 sampler)."""
    router_replay: bool = True
    """MoE: route tokens to the experts the sampler recorded (R3) when the turns carry them."""
    checkpoint_every: int = Field(1, ge=1)
    """Steps between checkpoints (torch distributed checkpoint of model and optimizer). On
    resume, groups consumed by steps after the last checkpoint go back to the buffer and the
    policies those steps published are withdrawn, so no group is lost or used twice."""
    keep_checkpoints: int = Field(2, ge=1)
    seed: int = 0
    sft: bool = False
    """SFT on the same data path: loss on sampled tokens with advantage 1 (e.g. oracle runs)."""
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    data: DataConfig = DataConfig()

    @model_validator(mode="after")
    def _sft(self) -> TrainerConfig:
        if self.sft:
            self.data = self.data.model_copy(update={"advantage_one": True})
        return self

    def torch_device(self) -> torch.device:
        """This process's device: with a GPU, the one of its torchrun local rank."""
        if self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ValueError("device: cuda asked for, but torch sees no GPU (set device = \"cpu\" or \"auto\")")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


@dataclass
class Batch:
    """One step's data, packed: what rank 0 hands every rank."""

    rows: list[Row]
    stats: BatchStats
    truncated: int
    n_tokens: int
    n_seqs: int


def load_config(path: Path, overrides: list[str] = ()) -> TrainerConfig:
    """The TOML file, with `--a.b=value` overrides (values parsed as JSON when they parse)."""
    raw = tomllib.loads(Path(path).read_text())
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: write --section.key=value")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parsed
    return TrainerConfig.model_validate(raw)


class Trainer:
    """The training loop. Under torchrun (WORLD_SIZE > 1) every process runs it: the model is
    sharded over the processes (FSDP2, expert parallelism), rank 0 alone talks to the database
    and the fleet, hands every rank the same packed batch, and each rank trains on its share
    of the batch's micro-batches."""

    def __init__(self, cfg: TrainerConfig, engine=None):
        """engine None on rank 0: the model, optimizer and step alone (benchmarks, the golden
        test); the loop (`run`) needs the database there."""
        from service.store.buffer import Buffer
        from trainer.model import apply_activation_checkpointing, apply_float8, build_model, set_expert_dtype
        from trainer.replay import enable

        self.cfg, self.engine = cfg, engine
        self.buffer = Buffer(engine) if engine is not None else None
        self.dir = cfg.out_dir / cfg.name
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        par = cfg.parallelism
        if self.world > 1 or par.world_size > 1:
            _check_distributed(par, self.world)
        self.device = cfg.torch_device()
        torch.manual_seed(cfg.seed)
        self.model, self.model_cfg, self.adapter = build_model(cfg.model, cfg.attn_backend, par.torch_dtype(),
                                                               self.device)
        self.model.train()
        set_expert_dtype(self.model, cfg.expert_dtype)
        self.moe_layers = enable(self.model)
        if par.float8:
            apply_float8(self.model)
        apply_activation_checkpointing(self.model, par.activation_checkpoint)
        if self.world > 1:
            from trainer.distributed import parallelize

            parallelize(self.model, self.model_cfg, world_size=self.world, fsdp=par.data_parallel_shard_degree,
                        ep=par.expert_parallel_degree, device_type=self.device.type)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                           weight_decay=cfg.optim.weight_decay)
        self.step = 0
        self.crash_after_commit: int | None = None
        if engine is not None and self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "config.json").write_text(cfg.model_dump_json(indent=2))

    # ---- ranks -------------------------------------------------------------------------------------

    def _share(self, obj):
        """Rank 0's `obj` on every rank (no-op in one process)."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    async def claim(self):
        """Claims holding groups_per_step useful groups (of the run, if set), and those groups.
        Groups that teach nothing (all advantages zero, no rewarded episode) ride along in the
        claims: consumed with the step and counted, never handed out again."""
        from trainer.data import group_advantages_of

        deadline = time.monotonic() + self.cfg.wait_s
        claims, useful, dropped, useless = [], [], 0, 0
        while len(useful) < self.cfg.groups_per_step:
            claim = await self.buffer.claim(self.cfg.groups_per_step - len(useful), trainer_step=self.step,
                                            max_staleness=self.cfg.max_off_policy_steps, lease_s=self.cfg.lease_s,
                                            run_id=self.cfg.run_id, owner=self.cfg.name)
            dropped += claim.dropped
            if claim.group_ids:
                claims.append(claim)
                for group in await self.buffer.load(claim):
                    if group_advantages_of(group, self.cfg.data) is not None:
                        useful.append(group)
                    else:
                        useless += 1
                continue
            if time.monotonic() > deadline:
                for c in claims:
                    await self.buffer.release(c)
                raise TimeoutError(f"no {self.cfg.groups_per_step} useful ready groups within {self.cfg.wait_s} s")
            await asyncio.sleep(1.0)
        return claims, useful, dropped, useless

    def prepare(self, groups) -> Batch:
        """Sequences of the groups' turns, packed into rows (rank 0; the batch every rank trains on)."""
        sequences, stats = sequences_from_groups(groups, self.cfg.data)
        rows, truncated = pack(sequences, self.cfg.data.seq_len)
        n_tokens = int(sum(r.loss_mask.sum() for r in rows))
        n_seqs = len({(i, sid) for i, r in enumerate(rows) for sid in set(r.seq_ids[r.loss_mask].tolist())})
        return Batch(rows, stats, truncated, n_tokens, n_seqs)

    def train_step(self, groups) -> dict:
        """Gradients of one batch (one process): prepare + train_batch."""
        return self.train_batch(self.prepare(groups))

    def micro_batches(self, rows: list[Row]) -> list[list[tuple[int, int, int] | None]]:
        """Every rank's micro-batches, (row, start, end), the same on every rank since they all
        hold the batch: whole rows in one process and on models that pack documents; under
        FSDP with SDPA (one forward per document anyway), documents, spread over the ranks by
        tokens. Every rank gets the same number: a rank with fewer pads with None (an idle
        pass), since every forward and backward of a sharded model is a collective all ranks
        must join."""
        whole = self.world == 1 or packs_documents(self.model)
        units = []
        for i, r in enumerate(rows):
            if not r.loss_mask.any():
                continue
            if whole:
                units.append((i, 0, len(r.inputs)))
                continue
            starts = np.flatnonzero(r.positions == 0)
            for s, e in zip(starts, [*starts[1:], len(r.inputs)]):
                if r.seq_ids[s] >= 0 and r.loss_mask[s:e].any():
                    units.append((i, int(s), int(e)))
        if self.world == 1:
            return [units]
        loads, shares = [0] * self.world, [[] for _ in range(self.world)]
        for unit in sorted(units, key=lambda u: (u[1] - u[2], u)):  # longest first, to the least loaded
            k = loads.index(min(loads))
            shares[k].append(unit)
            loads[k] += unit[2] - unit[1]
        longest = max(len(share) for share in shares)
        return [sorted(share) + [None] * (longest - len(share)) for share in shares]

    def _pieces(self, shares) -> list[int | None]:
        """Per round of micro-batches, the number of vocabulary projections every rank makes
        (the most any rank's micro-batch of that round needs); None in one process."""
        if self.world == 1:
            return [None] * len(shares[0])
        chunk = self.cfg.logprob_chunk
        return [max(projection_pieces(u[2] - u[1] if u else 1, chunk) for u in round_)
                for round_ in zip(*shares)]

    def _idle_pass(self, pieces: int | None) -> None:
        """A one-token forward and backward with zero loss: joins the collectives of a round."""
        x = torch.zeros(1, dtype=torch.long, device=self.device)
        logp, _ = forward_logprobs(self.model, x, x, x, x, pieces=pieces)
        (logp.sum() * 0.0).backward()

    def train_batch(self, batch: Batch) -> dict:
        """Forward and backward of this rank's share of the batch (gradients accumulate; the
        loss is normalised by the whole batch), metrics summed over the ranks, gradients clipped."""
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(4, dtype=torch.float64)  # loss, and mismatch KL, masked fraction, entropy token-weighted
        started = time.perf_counter()
        shares = self.micro_batches(batch.rows)
        for unit, pieces in zip(shares[self.rank], self._pieces(shares)):
            if unit is None:
                self._idle_pass(pieces)
                continue
            i, s, e = unit
            row = batch.rows[i]
            t = {k: torch.from_numpy(np.ascontiguousarray(getattr(row, k)[s:e])).to(self.device)
                 for k in ("inputs", "targets", "positions", "loss_mask", "inf_logprobs", "advantages", "seq_ids")}
            experts = None
            if cfg.router_replay and self.moe_layers and row.routed_experts is not None:
                experts = torch.from_numpy(np.ascontiguousarray(row.routed_experts[s:e])).to(self.device)
            logp, entropy = forward_logprobs(self.model, t["inputs"], t["positions"], t["seq_ids"], t["targets"],
                                             experts, chunk=cfg.logprob_chunk, pieces=pieces)
            # SFT: no sampler to correct for (scripted "samples" carry logprob 0): ratio 1, plain NLL
            inf = logp.detach() if cfg.sft else t["inf_logprobs"]
            out = policy_loss(logp, inf, t["advantages"], t["loss_mask"], cfg.loss, t["seq_ids"],
                              total_tokens=batch.n_tokens, total_sequences=batch.n_seqs)
            out.loss.backward()
            weight = out.metrics["sampled_tokens"] / max(batch.n_tokens, 1)
            sums += torch.tensor([out.loss.item(), out.metrics["mismatch_kl"] * weight,
                                  out.metrics["masked_fraction"] * weight,
                                  float(entropy[t["loss_mask"]].mean()) * weight], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(sums)
        grad_norm = None
        if cfg.optim.grad_clip is not None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            if self.world > 1:  # over every rank's shards, expert and non-expert meshes alike
                from torchtitan.distributed.utils import clip_grad_norm_

                norm = clip_grad_norm_(params, cfg.optim.grad_clip,
                                       ep_enabled=cfg.parallelism.expert_parallel_degree > 1)
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        elapsed = time.perf_counter() - started
        stats, rows = batch.stats, batch.rows
        used = sum(r.used for r in rows)
        loss, kl, masked, entropy = sums.tolist()
        return {
            "loss": loss, "mismatch_kl": kl, "masked_fraction": masked, "entropy": entropy,
            "reward_mean": float(np.mean(stats.rewards)) if stats.rewards else None,
            "advantage_mean": float(np.mean(stats.advantages)) if stats.advantages else None,
            "advantage_std": float(np.std(stats.advantages)) if stats.advantages else None,
            "groups": stats.groups, "zero_advantage_groups": stats.zero_advantage_groups,
            "episodes": stats.episodes, "excluded_episodes": stats.excluded_episodes,
            "sampled_tokens": batch.n_tokens, "tokens": used, "truncated_tokens": batch.truncated,
            "packing_efficiency": packing_efficiency(rows), "grad_norm": grad_norm,
            "step_s": elapsed, "tokens_per_s": used / elapsed if elapsed else None, "ranks": self.world,
        }  # fmt: skip

    # ---- weights -----------------------------------------------------------------------------------

    def _full_tensors(self):
        """(name, whole tensor) for every parameter and buffer, one at a time: sharded tensors are
        gathered (a collective every rank joins, in the same order); None on ranks other than 0."""
        from torch.distributed.tensor import DTensor

        dtype = self.cfg.parallelism.torch_dtype()
        for k, v in self.model.state_dict().items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            yield k, (v.detach().to("cpu", dtype).contiguous() if self.rank == 0 else None)

    def weights_dir(self, version: int) -> Path:
        return self.dir / "weights" / f"v{version}"

    def publish_weights(self, version: int) -> Path | None:
        """The weights in the inference model's layout: safetensors shards of at most
        `publish_shard_mb` (with Hugging Face's model.safetensors.index.json when there are
        several) + config + tokenizer, written by rank 0 into a temporary folder renamed when
        complete. Tensors are gathered one at a time and written a shard at a time, so rank 0
        never holds more than a shard of a model that only fits sharded."""
        from safetensors.torch import save_file

        out = self.weights_dir(version)
        tmp = out.with_name(out.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        limit = self.cfg.publish_shard_mb * 2**20
        shards: list[list[str]] = []  # the Hugging Face names in each written shard
        pending: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            nonlocal pending, size, total
            hf = {k: v.contiguous() for k, v in self.adapter.to_hf(pending).items()}
            if hf:  # (buffers such as rotary caches have no Hugging Face name)
                total += sum(v.nbytes for v in hf.values())
                save_file(hf, str(tmp / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
                shards.append(list(hf))
            pending, size = {}, 0

        for name, tensor in self._full_tensors():
            if tensor is None:
                continue
            if size and size + tensor.nbytes > limit:
                flush()
            pending[name] = tensor
            size += tensor.nbytes
        if self.rank != 0:
            return None
        flush()
        if len(shards) == 1:
            (tmp / "part-0.safetensors").rename(tmp / "model.safetensors")
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {}
            for i, (keys, name) in enumerate(zip(shards, names)):
                (tmp / f"part-{i}.safetensors").rename(tmp / name)
                weight_map |= dict.fromkeys(keys, name)
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        shutil.copy(self.cfg.model / "config.json", tmp / "config.json")
        for name in TOKENIZER_FILES:
            if (self.cfg.model / name).exists():
                shutil.copy(self.cfg.model / name, tmp / name)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out.resolve()

    async def publish(self, version: int, metrics: dict) -> list[str]:
        from service.fleet.client import FleetConfig, VLLMClient

        path = await asyncio.to_thread(self.publish_weights, version)
        if self.rank != 0:
            return []
        await self.buffer.record_policy(version, str(path), self.step, {k: v for k, v in metrics.items() if v is not None})
        if not self.cfg.endpoints:
            return []
        async with VLLMClient(FleetConfig(endpoints=self.cfg.endpoints, model=self.cfg.served_model)) as fleet:
            reloaded = await fleet.reload(str(path), version)
        if len(reloaded) != len(self.cfg.endpoints):
            logger.error("version %d: only %s of %s reloaded", version, reloaded, self.cfg.endpoints)
        return reloaded

    # ---- checkpoints -------------------------------------------------------------------------------

    def checkpoints(self) -> list[tuple[int, Path]]:
        root = self.dir / "checkpoints"
        found = []
        for d in root.glob("step-*") if root.exists() else []:
            if (d / "COMPLETE").exists():
                found.append((int(d.name.removeprefix("step-")), d))
        return sorted(found)

    def save_checkpoint(self) -> Path:
        """Model and optimizer state through torch.distributed.checkpoint, each rank writing its
        own shards. torchtitan's fused QKV renames its keys in state_dict hooks, so the plain
        module and optimizer state dicts are saved, not get_state_dict's."""
        import torch.distributed.checkpoint as dcp

        path = self.dir / "checkpoints" / f"step-{self.step}"
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self._barrier()
        dcp.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}, checkpoint_id=str(path))
        self._barrier()
        if self.rank == 0:
            (path / "COMPLETE").write_text(json.dumps({"step": self.step, "ranks": self.world}))  # last: a torn save is ignored
            for _, old in self.checkpoints()[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return path

    def load_checkpoint(self, path: Path, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self._materialize_optimizer_state()
        state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        dcp.load(state, checkpoint_id=str(path))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.step = step

    def _materialize_optimizer_state(self) -> None:
        """A step with zero gradients and zero learning rate: the optimizer's state tensors exist
        (with their shapes) for the checkpoint to be loaded into, and no weight moves."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr

    async def resume(self) -> None:
        """Back to the last checkpoint (or the initial weights): later steps never happened."""
        from service.store.tables import Policy

        found = self._share(self.checkpoints())  # rank 0's view: the ranks load the same one
        if found:
            step, path = found[-1]
            await asyncio.to_thread(self.load_checkpoint, path, step)
        else:
            self.step = 0
        publish = write = False
        if self.rank == 0:
            back, withdrawn = await self.buffer.rewind(self.step, self.cfg.run_id)
            # the step that was running when this trainer died held claims; they are ours
            unclaimed = await self.buffer.release_owner(self.cfg.name, self.cfg.run_id)
            if back or withdrawn or unclaimed:
                logger.warning("resumed at step %d: %d consumed and %d claimed group(s) back to the buffer, "
                               "%d policy version(s) withdrawn", self.step, back, unclaimed, withdrawn)
            if self.step == 0:
                await self._record_initial_policy()
            else:  # died between the checkpoint and the publication: publish now
                async with self.engine.connect() as conn:
                    published = await conn.scalar(sa.select(Policy.version).where(Policy.version == self.step))
                publish = published is None
                write = bool(self.cfg.endpoints) and not self.weights_dir(self.step).exists()
        publish, write = self._share((publish, write))
        if publish:
            await self.publish(self.step, {"republished": True})
        elif write:
            await asyncio.to_thread(self.publish_weights, self.step)
        if self.cfg.endpoints and self.rank == 0:  # the fleet serves what this trainer now is, before anything else
            from service.fleet.client import FleetConfig, VLLMClient

            path = self.weights_dir(self.step) if self.step else self.cfg.model
            async with VLLMClient(FleetConfig(endpoints=self.cfg.endpoints, model=self.cfg.served_model)) as fleet:
                if fleet.version != self.step or found:
                    await fleet.reload(str(Path(path).resolve()), self.step)
        self._barrier()

    async def run(self) -> list[dict]:
        from service.store.buffer import ClaimLost

        if self.rank == 0 and self.buffer is None:
            raise ValueError("Trainer.run needs a database engine")
        await self.resume()
        history = []
        while self.cfg.steps == 0 or len(history) < self.cfg.steps:
            news = None
            if self.rank == 0:
                try:
                    claims, groups, dropped, useless = await self.claim()
                    staleness = [self.step - g.episodes[0].policy_version_min for g in groups
                                 if g.episodes and g.episodes[0].policy_version_min is not None]
                    news = ("batch", self.prepare(groups), dropped, useless, staleness)
                except Exception as e:
                    self._share(("error", f"{type(e).__name__}: {e}"))  # the other ranks stop too
                    raise
            news = self._share(news)
            if news[0] == "error":
                raise RuntimeError(f"rank 0 stopped: {news[1]}")
            _, batch, dropped, useless, staleness = news
            metrics = await asyncio.to_thread(self.train_batch, batch)
            lost = None
            if self.rank == 0:
                try:
                    for claim in claims:  # consumed by the step that makes version step+1
                        await self.buffer.commit(claim, trainer_step=self.step + 1)
                except ClaimLost as e:  # the lease ran out: the groups went back; do not apply this step
                    lost = str(e)
            lost = self._share(lost)
            if lost is not None:
                logger.warning("step %d discarded: %s", self.step, lost)
                self.optimizer.zero_grad(set_to_none=True)
                continue
            self.optimizer.step()
            self.step += 1
            if self.crash_after_commit == self.step:  # tests: the worst moment to die
                raise RuntimeError(f"crash injected after step {self.step} committed")
            if self.step % self.cfg.checkpoint_every == 0:
                await asyncio.to_thread(self.save_checkpoint)
            metrics |= {"step": self.step, "dropped_groups": dropped, "zero_advantage_groups": useless,
                        "staleness_mean": float(np.mean(staleness)) if staleness else None,
                        "staleness_max": max(staleness) if staleness else None}
            metrics["reloaded"] = await self.publish(self.step, metrics)
            if self.rank == 0:
                with open(self.dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(metrics) + "\n")
                logger.info("step %d: %s", self.step, {k: metrics[k] for k in ("loss", "reward_mean", "mismatch_kl")})
            history.append(metrics)
        return history

    async def _record_initial_policy(self) -> None:
        await self.buffer.record_policy(0, str(self.cfg.model.resolve()), 0, if_absent=True)


def _check_distributed(par: ParallelismConfig, world: int) -> None:
    """What the loop runs over several processes today: FSDP2 and expert parallelism."""
    if par.world_size != world:
        raise ValueError(f"parallelism.world_size: {par.world_size}, but {world} process(es) run "
                         f"(start with torchrun --nproc_per_node {par.world_size}, or swerve train --nproc)")
    if par.tensor_parallel_degree > 1:
        raise ValueError("parallelism.tensor_parallel_degree: the training loop shards with FSDP2 and expert "
                         "parallelism only; set it to 1")
    if par.context_parallel_degree > 1:
        raise ValueError("parallelism.context_parallel_degree: context parallelism is checked by the layout "
                         "(trainer/layout.py) but not yet run by the loop; set it to 1")


def init_distributed(cfg: TrainerConfig) -> int:
    """Join torchrun's process group (gloo on CPU, NCCL on GPUs); returns the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        device = cfg.torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # rank 0 may wait up to wait_s for groups while the others wait for it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=cfg.wait_s + 600))
    return world


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

"""The trainer's experiment config: what to train, how it is laid out over processes, how it
optimises. Loaded from TOML with `--section.key=value` overrides; every field is checked here,
before a model is built."""

from __future__ import annotations

import json
import math
import os
import tomllib
import uuid
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.data import DataConfig
from trainer.loss import LossConfig


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    """The learning rate rises linearly over the run's first steps (torchtitan's linear warmup:
    lr x (step + 1) / (warmup_steps + 1)). A run started from weights with a fresh optimizer
    (RL from an SFT checkpoint) otherwise moves every parameter by about lr in its first steps:
    Adam's first updates are the gradient's sign."""

    decay_steps: int = Field(0, ge=0)
    """The learning rate falls over the decay_steps updates that end at version decay_end, and
    stays at min_lr_factor x lr after it (torchtitan's warmup-stable-decay schedule, its decay
    placed by a version rather than a share of the run, as the trainer runs to a version or a time
    limit). 0: constant after the warmup. An SFT run at a constant rate ends wherever its last
    noisy update left it; the decay averages its last stretch."""
    decay_end: int | None = Field(None, ge=1)
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    min_lr_factor: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _decay(self) -> OptimConfig:
        if self.decay_steps and (self.decay_end is None or self.decay_end < self.decay_steps):
            raise ValueError(f"optim.decay_end: give the version the decay ends at, at least decay_steps "
                             f"({self.decay_steps}); got {self.decay_end}")
        return self

    def lr_at(self, step: int) -> float:
        """The learning rate of the update that makes version step + 1."""
        lr = self.lr * min(1.0, (step + 1) / (self.warmup_steps + 1))
        if not self.decay_steps:
            return lr
        progress = min(1.0, max(0.0, (step - (self.decay_end - self.decay_steps)) / self.decay_steps))
        left = {"linear": 1.0 - progress, "sqrt": 1.0 - math.sqrt(progress),
                "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[self.decay_type]
        return lr * (self.min_lr_factor + (1.0 - self.min_lr_factor) * left)


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


class DatasetConfig(BaseModel):
    """Train on a finished run's groups as a fixed dataset (SFT on demonstrations): every step
    takes the next groups_per_step of them, in an order shuffled per epoch with the trainer's
    seed, and claims nothing, so the same trajectories serve epoch after epoch."""

    model_config = ConfigDict(extra="forbid")
    run_id: uuid.UUID
    """The run whose ready (or consumed) groups are the dataset."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the dataset (None: as many as steps, until_step or time_limit_s allow)."""


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
    """Steps to train in this process (0: until stopped)."""
    until_step: int | None = Field(None, ge=1)
    """Stop once the trainer's step reaches this (a job's last step: a resumed trainer trains
    only the steps left); None: no such bound."""
    evaluate_every: int | None = Field(None, ge=1)
    """The run's evaluations (`swerve rl`): before training on a version that is a multiple of
    this, wait until its evaluation ended, so that it sampled only that version."""
    groups_per_step: int = Field(4, ge=1)
    fill_useful: bool = True
    """Claim until groups_per_step groups teach something (non-zero advantages), as DAPO's
    dynamic sampling; False: a step takes the next groups_per_step groups whatever they teach
    (a step may then have nothing to learn from, and still makes a version)."""
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
    dataset: DatasetConfig | None = None
    """Train on a run's groups as a fixed dataset instead of claiming from the buffer."""
    time_limit_s: float | None = Field(None, gt=0)
    """Stop after the first step that ends this long after this process started training. With a
    training run (run_id, no dataset) that step's version becomes the run's last: it is evaluated
    as the last and the run ends (service.control.training.last_version)."""
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


def load_config(path: Path, overrides: list[str] = ()) -> TrainerConfig:
    """The TOML file (or JSON, as `swerve rl` writes it), with `--a.b=value` overrides (values
    parsed as JSON when they parse)."""
    text = Path(path).read_text()
    raw = json.loads(text) if Path(path).suffix == ".json" else tomllib.loads(text)
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

"""The trainer over several processes: joining torchrun's process group, sharding the model
with torchtitan's FSDP2 (and expert parallelism for MoE models), and spreading a batch's
micro-batches over the ranks. Every rank runs the same number of forward and backward passes,
since each one is a collective all ranks must join."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from trainer.config import ParallelismConfig, TrainerConfig
from trainer.data import Row
from trainer.model import projection_pieces

SPMD_BACKEND = "partial_dtensor"
Unit = tuple[int, int, int]
"""A micro-batch: (row, start, end) of the batch's packed rows."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job; rank 0 alone talks to the database and the fleet."""

    world: int
    rank: int
    device: torch.device

    @classmethod
    def joined(cls, cfg: TrainerConfig) -> Ranks:
        """This process's rank in the process group (if any), checked against the config."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        if world > 1 or cfg.parallelism.world_size > 1:
            check_distributed(cfg.parallelism, world)
        return cls(world, rank, cfg.torch_device())

    def share(self, obj):
        """Rank 0's `obj` on every rank (no-op in one process)."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


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


def check_distributed(par: ParallelismConfig, world: int) -> None:
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


def _annotate_sharding(model, config, *, enable_ep: bool) -> None:
    """Give every module of `model` the sharding_config torchtitan would have built it with:
    torchtitan fills it on the model *config* before building, build_model builds without it,
    so a twin is built from an annotated copy on the meta device (free) and copied by name."""
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    annotated = copy.deepcopy(config)
    set_qwen3_sharding_config(annotated, enable_sp=False, enable_ep=enable_ep)
    with torch.device("meta"):
        twin = annotated.build()
    twins = dict(twin.named_modules())
    for name, module in model.named_modules():
        sharding = getattr(twins.get(name), "_sharding_config", None)
        if sharding is not None:
            module._sharding_config = sharding


def parallelize(model, config, *, world_size: int, fsdp: int = -1, ep: int = 1, device_type: str = "cpu"):
    """Shard `model` (built by build_model, not yet run) in place over `world_size` ranks
    (gloo on CPU, NCCL on GPUs): FSDP2 over `fsdp` ranks (-1: all), routed experts split over
    `ep` ranks (MoE models). The process group must be initialised. Returns torchtitan's
    ParallelDims (its meshes). Workarounds for torchtitan 0.3.0 on CPU: ../shared/PLATFORM.md."""
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.config import ParallelismConfig as TitanParallelism
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    titan_parallel_dims.device_type = device_type  # picked once at import: "cuda" when no accelerator
    # the legacy path keeps data parallelism out of band (FSDP2 hooks); "spmd_types" would type
    # every activation over all mesh axes
    set_spmd_backend(SPMD_BACKEND)
    parallelism = TitanParallelism(data_parallel_shard_degree=fsdp, expert_parallel_degree=ep,
                                   enable_sequence_parallel=False, spmd_backend=SPMD_BACKEND)
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    if ep > 1:
        _annotate_sharding(model, config, enable_ep=True)
    # float32 parameters in forward: torchtitan's default casts them to bf16 (mixed precision)
    training = TrainingConfig(mixed_precision_param="float32")
    parallelize_qwen3(model, parallel_dims=dims, training=training, parallelism=parallelism,
                      compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # gloo has no PREMUL_SUM: gradients are summed unscaled over the ranks, so the loss
            # carries the scale (policy_loss divides by the whole batch's sampled tokens)
            module.set_force_sum_reduction_for_comms(True)
    return dims


def micro_batches(rows: list[Row], world: int, split_documents: bool) -> list[list[Unit | None]]:
    """Every rank's micro-batches, the same on every rank since they all hold the batch: whole
    rows in one process or without `split_documents` (models that pack documents); otherwise
    (FSDP with SDPA: one forward per document anyway) documents, spread over the ranks by
    tokens. Every rank gets the same number: a rank with fewer pads with None (an idle pass)."""
    whole = world == 1 or not split_documents
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
    if world == 1:
        return [units]
    loads, shares = [0] * world, [[] for _ in range(world)]
    for unit in sorted(units, key=lambda u: (u[1] - u[2], u)):  # longest first, to the least loaded
        k = loads.index(min(loads))
        shares[k].append(unit)
        loads[k] += unit[2] - unit[1]
    longest = max(len(share) for share in shares)
    return [sorted(share) + [None] * (longest - len(share)) for share in shares]


def projection_rounds(shares: list[list[Unit | None]], chunk: int) -> list[int | None]:
    """Per round of micro-batches, the number of vocabulary projections every rank makes (the
    most any rank's micro-batch of that round needs); None in one process."""
    if len(shares) == 1:
        return [None] * len(shares[0])
    return [max(projection_pieces(u[2] - u[1] if u else 1, chunk) for u in round_) for round_ in zip(*shares)]

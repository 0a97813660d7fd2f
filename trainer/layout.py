"""Shape checks of a trainer config on the meta device: the model builds at its real size with
no memory, and the parallel layout fits it (degrees multiply to the world size, experts split
evenly over expert-parallel ranks, heads over tensor-parallel ranks). Used by tests and by
`python -m trainer --check` (`swerve train --check`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from trainer.config import TrainerConfig


class LayoutError(ValueError):
    """The config cannot be laid out; the message names the field."""


@dataclass
class Layout:
    params: int
    active_params: int
    layers: int
    moe_layers: int
    experts: int | None
    bytes_per_rank: float
    """Parameters + gradients + Adam state per rank under FSDP (and EP for experts)."""


def model_config(cfg: TrainerConfig):
    if cfg.titan_flavor is None:
        from trainer.model import titan_config

        return titan_config(cfg.model, "flex" if cfg.attn_backend == "sdpa" else cfg.attn_backend)
    family, _, flavor = cfg.titan_flavor.partition(":")
    try:
        module = importlib.import_module(f"torchtitan.models.{family}")
    except ImportError as e:
        raise LayoutError(f"titan_flavor: torchtitan has no model family {family!r}") from e
    try:
        return module.model_registry(flavor).model
    except KeyError as e:
        raise LayoutError(f"titan_flavor: {family} has no flavor {flavor!r}") from e


def check(cfg: TrainerConfig) -> Layout:
    mc = model_config(cfg)
    with torch.device("meta"):
        model = mc.build()
    params = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if "routed_experts" in n)
    moe = [layer.moe for layer in mc.layers if getattr(layer, "moe", None) is not None]
    experts = moe[0].num_experts if moe else None
    top_k = moe[0].router.top_k if moe else None
    active = params - expert_params + (expert_params * top_k // experts if moe else 0)
    par = cfg.parallelism
    dp = par.fsdp()
    if dp < 1 or dp * par.tensor_parallel_degree * par.context_parallel_degree != par.world_size:
        raise LayoutError(f"parallelism: data_parallel_shard_degree {dp} x tensor {par.tensor_parallel_degree} x "
                          f"context {par.context_parallel_degree} must equal world_size {par.world_size}")
    if par.expert_parallel_degree > 1:
        if not moe:
            raise LayoutError("parallelism.expert_parallel_degree: the model has no MoE layers")
        if experts % par.expert_parallel_degree:
            raise LayoutError(f"parallelism.expert_parallel_degree: {par.expert_parallel_degree} does not divide "
                              f"the {experts} experts")
        if (dp * par.context_parallel_degree) % par.expert_parallel_degree:
            raise LayoutError(f"parallelism.expert_parallel_degree: {par.expert_parallel_degree} must divide "
                              f"data_parallel_shard_degree x context_parallel_degree = {dp * par.context_parallel_degree}")
    heads = getattr(mc.first_attention, "n_heads", None)
    if heads and heads % par.tensor_parallel_degree:
        raise LayoutError(f"parallelism.tensor_parallel_degree: {par.tensor_parallel_degree} does not divide {heads} heads")
    if cfg.data.seq_len % (2 * par.context_parallel_degree) and par.context_parallel_degree > 1:
        raise LayoutError(f"data.seq_len: {cfg.data.seq_len} must be a multiple of 2 x context_parallel_degree")
    width = par.torch_dtype().itemsize
    per_param = width + width + 8  # weights, gradients, Adam moments in float32
    # FSDP2 shards over data x context parallel ranks (and TP splits further); experts are split
    # over EP ranks and FSDP-sharded over the rest of those ranks: everything ends up / world_size
    return Layout(params, active, len(mc.layers), len(moe), experts, params * per_param / par.world_size)

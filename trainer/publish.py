"""Publication of a policy version: its weights in the inference model's layout (safetensors
shards + config + tokenizer, in a folder renamed into place when complete), then its record in
the database, then every server of the fleet reloaded with it."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from service.fleet.client import FleetConfig, VLLMClient
from service.store.buffer import Buffer
from trainer.config import TrainerConfig

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")


def weights_dir(run_dir: Path, version: int) -> Path:
    return run_dir / "weights" / f"v{version}"


def write_weights(model, adapter, cfg: TrainerConfig, out: Path, rank: int) -> Path | None:
    """Safetensors shards of at most `publish_shard_mb` (with Hugging Face's
    model.safetensors.index.json when there are several) + config + tokenizer, written by rank
    0. Every rank must call it: tensors are gathered one at a time and written a shard at a
    time, so rank 0 never holds more than a shard of a model that only fits sharded."""
    tmp = out.with_name(out.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    tensors = _full_tensors(model, cfg.parallelism.torch_dtype(), rank)
    shards, total = _write_shards(tensors, adapter, tmp, cfg.publish_shard_mb * 2**20)
    if rank != 0:
        return None
    _name_shards(tmp, shards, total)
    shutil.copy(cfg.model / "config.json", tmp / "config.json")
    for name in TOKENIZER_FILES:
        if (cfg.model / name).exists():
            shutil.copy(cfg.model / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out.resolve()


def _full_tensors(model, dtype: torch.dtype, rank: int) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, whole tensor) for every parameter and buffer, one at a time: sharded tensors are
    gathered (a collective every rank joins, in the same order); None on ranks other than 0."""
    from torch.distributed.tensor import DTensor

    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        yield k, (v.detach().to("cpu", dtype).contiguous() if rank == 0 else None)


def _write_shards(tensors, adapter, folder: Path, limit: int) -> tuple[list[list[str]], int]:
    """part-<i>.safetensors files of at most `limit` bytes; returns the Hugging Face names in
    each file written and the bytes written."""
    shards: list[list[str]] = []
    total, pending, size = 0, {}, 0
    for name, tensor in tensors:
        if tensor is None:
            continue
        if size and size + tensor.nbytes > limit:
            total += _write_part(pending, adapter, folder, shards)
            pending, size = {}, 0
        pending[name] = tensor
        size += tensor.nbytes
    if pending:
        total += _write_part(pending, adapter, folder, shards)
    return shards, total


def _write_part(tensors: dict[str, torch.Tensor], adapter, folder: Path, shards: list[list[str]]) -> int:
    """One part file, its names appended to `shards`; returns its bytes."""
    from safetensors.torch import save_file

    hf = {k: v.contiguous() for k, v in adapter.to_hf(tensors).items()}
    if not hf:  # buffers such as rotary caches have no Hugging Face name
        return 0
    save_file(hf, str(folder / f"part-{len(shards)}.safetensors"), metadata={"format": "pt"})
    shards.append(list(hf))
    return sum(v.nbytes for v in hf.values())


def _name_shards(folder: Path, shards: list[list[str]], total: int) -> None:
    """The part files renamed as Hugging Face names them, with an index when there are several."""
    if len(shards) == 1:
        (folder / "part-0.safetensors").rename(folder / "model.safetensors")
        return
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for i, (keys, name) in enumerate(zip(shards, names)):
        (folder / f"part-{i}.safetensors").rename(folder / name)
        weight_map |= dict.fromkeys(keys, name)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


async def announce(buffer: Buffer, cfg: TrainerConfig, version: int, path: Path, trainer_step: int,
                   metrics: dict) -> list[str]:  # fmt: skip
    """Rank 0, the weights written: the version recorded with the step's metrics, then the
    fleet reloaded with it. Returns the servers that reloaded."""
    await buffer.record_policy(version, str(path), trainer_step, {k: v for k, v in metrics.items() if v is not None})
    if not cfg.endpoints:
        return []
    async with _fleet(cfg) as fleet:
        reloaded = await fleet.reload(str(path), version)
    if len(reloaded) != len(cfg.endpoints):
        logger.error("version %d: only %s of %s reloaded", version, reloaded, cfg.endpoints)
    return reloaded


async def serve(cfg: TrainerConfig, path: Path, version: int, *, force: bool) -> None:
    """The fleet reloaded with `version` (weights at `path`) unless it serves it already and
    not `force`."""
    async with _fleet(cfg) as fleet:
        if fleet.version != version or force:
            await fleet.reload(str(Path(path).resolve()), version)


def _fleet(cfg: TrainerConfig) -> VLLMClient:
    # the servers answer slowly while they sample on busy cores: a trainer waits for them
    return VLLMClient(FleetConfig(endpoints=cfg.endpoints, model=cfg.served_model, probe_timeout_s=60.0))

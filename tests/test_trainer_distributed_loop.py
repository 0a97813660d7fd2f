"""`swerve train --nproc 2`: the training loop itself over two gloo processes on CPU (FSDP2; FSDP2
+ expert parallelism for the MoE), against the buffer in PostgreSQL. Rank 0 claims and hands
out the batch, the ranks split its documents (a rank with fewer runs idle passes, or the
collectives would deadlock), checkpoints are sharded, full weights are gathered for
publication. The losses, gradient norms and published weights must match a one-process run
on the same buffer, and a restarted two-process trainer must resume from its sharded
checkpoint."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch

from service.store import db
from service.store.tables import Group, Policy
from service.fleet.tiny_model import TinyModelSpec, init_tiny
from tests.conftest import clean_env, _truncate_pg, require_torchtitan

require_torchtitan()

from tests.test_trainer import fill_buffer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# three samples per group: three documents per step, so with two ranks one of them idles once
REWARDS = [[1.0, 0.0, 0.5], [0.0, 1.0, 1.0], [0.5, 0.0, 1.0]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"dense": init_tiny(root / "dense"), "moe": init_tiny(root / "moe", TinyModelSpec(moe=True))}


async def fill(url: str, model_dir: Path) -> uuid.UUID:
    """A fresh buffer: three ready groups of three episodes, the same every time."""
    from trainer.model import build_model

    _truncate_pg(url)
    model, _, _ = build_model(model_dir)
    engine = db.make_async_engine(url)
    try:
        return await fill_buffer(engine, model, REWARDS, samples=3)
    finally:
        await engine.dispose()


async def state(url: str) -> tuple[list[int], list[int | None]]:
    engine = db.make_async_engine(url)
    try:
        async with engine.connect() as conn:
            versions = (await conn.execute(sa.select(Policy.version).order_by(Policy.version))).scalars().all()
            steps = (await conn.execute(sa.select(Group.trainer_step).order_by(Group.ready_at))).scalars().all()
        return list(versions), list(steps)
    finally:
        await engine.dispose()


def train(config: Path, tmp_path: Path, name: str, *args: str) -> list[dict]:
    env = clean_env() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "service.cli", "train", "--config", str(config), f"--name={name}",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# The loss is a sum of +-A*w terms of size ~0.3 whose advantages cancel within each group (its
# value is ~1e-5..1e-4), so it is compared with an absolute tolerance on the scale of the terms.
# The MoE's experts compute in float32 on both sides (torchtitan's bfloat16 rounds differently on
# AVX2, AVX-512 and AMX CPUs and for different batch compositions), so what differs is the order
# of float32 sums: (n - 1) u of the terms for n <= 30 sampled tokens, far below loss_abs.
@pytest.mark.parametrize("kind,extra,loss_abs,rel", [
    # FSDP2: every matmul sees the tokens it sees in one process; float32 sums in another order
    ("dense", [], 1e-7, 1e-5),
    # EP: a rank's grouped expert matmul holds both ranks' tokens: its weight gradients are float32
    # sums over up to all of a step's tokens in another order
    ("moe", ["--parallelism.expert_parallel_degree=2"], 1e-6, 1e-4),
])
async def test_two_process_loop_matches_one_process_and_resumes(migrated_pg_url, tiny, tmp_path, kind, extra,
                                                                loss_abs, rel):  # fmt: skip
    config = tmp_path / "t.toml"
    config.write_text(f'model = "{tiny[kind]}"\nout_dir = "{tmp_path}"\ndatabase_url = "{migrated_pg_url}"\n'
                      # a small projection chunk: rows and documents are projected in pieces, and
                      # the ranks (the idle one too) must make as many projections as each other
                      'groups_per_step = 1\nwait_s = 30\nseed = 0\nlogprob_chunk = 8\nexpert_dtype = "float32"\n'
                      '[data]\nseq_len = 64\n[optim]\nlr = 1e-3\n')

    await fill(migrated_pg_url, tiny[kind])
    one = train(config, tmp_path, "one", "--steps=2")

    await fill(migrated_pg_url, tiny[kind])
    two = train(config, tmp_path, "two", "--steps=2", "--nproc=2", "--parallelism.world_size=2", *extra)
    assert [m["step"] for m in two] == [1, 2] and all(m["ranks"] == 2 for m in two)
    for a, b in zip(one, two):
        assert b["sampled_tokens"] == a["sampled_tokens"] == 3 * 2 * 5 and b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=0, abs=loss_abs)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel)
        assert b["mismatch_kl"] == pytest.approx(a["mismatch_kl"], rel=1e-3, abs=1e-9)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
    assert two[0]["mismatch_kl"] < 1e-6  # step 1 trains on data the initial weights sampled
    # the weights after two steps, gathered from the shards, are the one-process weights
    w1, w2 = weights(tmp_path / "one" / "weights" / "v2"), weights(tmp_path / "two" / "weights" / "v2")
    assert w1.keys() == w2.keys()
    moved = max(float((w2[k] - weights(tiny[kind])[k]).abs().max()) for k in w2)
    assert moved > 1e-4  # training moved them
    for k in w1:
        diff = (w2[k] - w1[k]).abs()
        if kind == "dense":
            assert float(diff.max()) < 2e-5, k
        else:
            # Adam moves every element by about lr whatever its gradient's size, so an element
            # whose gradient is ~0 and rounds (float32 sums in another order, see above) to the
            # other sign lands 2 lr away: a few per thousand may, by at most 2 lr per step; no more.
            assert float((diff > 2e-4).float().mean()) < 2e-3 and float(diff.max()) <= 2 * 2 * 1e-3, k
    ckpt = tmp_path / "two" / "checkpoints" / "step-2"
    assert (ckpt / "COMPLETE").exists() and {p.name for p in ckpt.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}

    # a new two-process trainer resumes from the sharded checkpoint and trains on the last group
    more = train(config, tmp_path, "two", "--steps=1", "--nproc=2", "--parallelism.world_size=2", *extra)
    assert [m["step"] for m in more] == [1, 2, 3]  # metrics.jsonl keeps the earlier steps
    versions, steps = await state(migrated_pg_url)
    assert versions == [0, 1, 2, 3] and steps == [1, 2, 3]  # every group consumed once, in order
    # the one-process trainer, resumed likewise from its step 2, takes the third group back
    # (consumed by a step after its checkpoint) and trains on it: the same step 3
    one_more = train(config, tmp_path, "one", "--steps=1")
    assert more[-1]["loss"] == pytest.approx(one_more[-1]["loss"], rel=0, abs=loss_abs * 10)
    assert more[-1]["grad_norm"] == pytest.approx(one_more[-1]["grad_norm"], rel=rel * 10)


async def test_two_process_trainer_sigkilled_mid_run_resumes_exactly_once(migrated_pg_url, tiny, tmp_path):
    """The whole torchrun job (both ranks and the launcher) SIGKILLed while step 2 holds its
    claim; started again, the trainer takes its own claim back at once (no waiting out the
    lease), the two ranks resume from their last complete sharded checkpoint: every group is
    consumed by exactly one step, the versions run 0..N without a gap."""
    import signal
    import time

    config = tmp_path / "t.toml"
    config.write_text(f'model = "{tiny["dense"]}"\nout_dir = "{tmp_path}"\ndatabase_url = "{migrated_pg_url}"\n'
                      'groups_per_step = 1\nwait_s = 30\n[data]\nseq_len = 64\n[optim]\nlr = 1e-3\n'
                      '[parallelism]\nworld_size = 2\n')
    await fill(migrated_pg_url, tiny["dense"])
    env = clean_env() | {"OMP_NUM_THREADS": "1"}
    metrics = tmp_path / "killed" / "metrics.jsonl"
    job = subprocess.Popen([sys.executable, "-m", "service.cli", "train", "--config", str(config), "--name=killed",
                            "--steps=3", "--nproc=2"], cwd=REPO, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=open(tmp_path / "first.log", "w"))
    try:
        # the worst moment: step 1 published and step 2 holding its claim (a lease of 600 s,
        # longer than the restarted trainer would wait for groups)
        watch = db.make_engine(migrated_pg_url)
        claimed = 0
        for _ in range(1200):
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                with watch.connect() as conn:
                    claimed = conn.scalar(sa.select(sa.func.count()).where(Group.status == "claimed"))
            if claimed or job.poll() is not None:
                break
            time.sleep(0.05)
        watch.dispose()
        assert job.poll() is None and claimed == 1, (tmp_path / "first.log").read_text()[-3000:]
    finally:  # torchrun starts each rank in a session of its own: kill the whole tree, as a scheduler would
        import psutil

        tree = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        job.wait()
        psutil.wait_procs(tree, timeout=10)
    done = max((int(d.parent.name.removeprefix("step-")) for d in
                (tmp_path / "killed" / "checkpoints").glob("step-*/COMPLETE")), default=0)
    assert 1 <= done < 3
    left = train(config, tmp_path, "killed", f"--steps={3 - done}", "--nproc=2")
    versions, steps = await state(migrated_pg_url)
    assert versions == [0, 1, 2, 3] and steps == [1, 2, 3], (versions, steps)  # none lost, none twice
    assert [m["step"] for m in left][-1] == 3

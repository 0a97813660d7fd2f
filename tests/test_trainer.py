"""The trainer on the tiny models: torchtitan model = served weights, published weights load
back in transformers, a training loop on the PostgreSQL/SQLite buffer, and a golden loss."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
import torch

from service.fleet.tiny_model import TinyModelSpec, init_tiny
from service.store import db
from service.store.buffer import Buffer
from service.store.records import TurnRecord
from service.store.tables import Episode, Group, Policy
from tests.conftest import clean_env, require_torchtitan  # noqa: E402
from tests.golden import GOLDEN, GOLDEN_CONFIG, golden_group
from tests.test_orchestrator import make_run

require_torchtitan()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"dense": init_tiny(root / "dense"), "moe": init_tiny(root / "moe", TinyModelSpec(moe=True))}


def hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind,tol", [("dense", 1e-5), ("moe", 5e-3)])
def test_titan_model_computes_what_the_served_model_computes(tiny, kind, tol):
    """MoE: torchtitan's grouped experts run in bf16, hence the looser tolerance."""
    from trainer.model import build_model

    model, _, _ = build_model(tiny[kind])
    ids = torch.randint(0, 2000, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(96)[None])
    torch.testing.assert_close(ours.float(), hf_logits(tiny[kind], ids), atol=tol, rtol=0)


def test_documents_in_a_row_do_not_see_each_other(tiny):
    from trainer.model import build_model, forward_logits

    model, _, _ = build_model(tiny["dense"])
    a, b = torch.randint(0, 2000, (20,)), torch.randint(0, 2000, (12,))
    row = torch.cat([a, b])
    positions = torch.cat([torch.arange(20), torch.arange(12)])
    with torch.no_grad():
        packed = forward_logits(model, row, positions, torch.tensor([0] * 20 + [1] * 12))
        alone = model(b[None], torch.arange(12)[None])[0]
    torch.testing.assert_close(packed[20:], alone)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_documents_of_the_same_length_run_as_one_batch_and_compute_what_each_does_alone(tiny, kind):
    """A row of documents 20, 12, 20, 7 (padding), 12 tokens long: the two 20s and the two 12s run
    batched (MoE: their routed experts replayed as a batch); each document's logits and the
    gradient are those of running it alone (float32; only the order of summation in the matrix
    products may differ)."""
    from trainer.model import build_model, forward_logits
    from trainer.replay import replaying

    model, _, _ = build_model(tiny[kind])
    lengths, ids = [20, 12, 20, 7, 12], [0, 1, 2, -1, 3]
    docs = [torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(k)) for k, n in enumerate(lengths)]
    row = torch.cat(docs)
    positions = torch.cat([torch.arange(n) for n in lengths])
    seq_ids = torch.cat([torch.full((n,), i) for n, i in zip(lengths, ids)])
    routed = None
    if kind == "moe":  # experts chosen at random, as a sampler's choices are not the trainer's
        n_layers = sum(getattr(layer, "moe", None) is not None for layer in model.layers.values())
        top_k = model.layers["0"].moe.router.top_k
        routed = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:top_k]
                              for t in range(len(row) * n_layers)]).view(len(row), n_layers, top_k)
    packed = forward_logits(model, row, positions, seq_ids, routed)
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(9))
    (packed * weights).sum().backward()
    batched_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    start, loss = 0, 0
    for doc, n, i in zip(docs, lengths, ids):
        if i >= 0:
            if routed is None:
                alone = model(doc[None], torch.arange(n)[None])[0]
            else:
                with replaying(model, routed[start:start + n]):
                    alone = model(doc[None], torch.arange(n)[None])[0]
            torch.testing.assert_close(packed[start:start + n].detach(), alone.detach())
            loss = loss + (alone * weights[start:start + n]).sum()
        start += n
    loss.backward()
    for batched, p in zip(batched_grads, model.parameters()):
        # a gradient sums over every token of the row in float32: summed in another order, its
        # entries agree to ~1e-7 per term of the largest one. MoE: the grouped experts multiply in
        # bf16 (8 bits of mantissa), grouped differently batched and alone
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(batched, p.grad, rtol=0, atol=(1e-5 if kind == "dense" else 2**-6) * scale)


def test_unsupported_models_are_named(tmp_path):
    from trainer.model import ModelError, titan_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="model_type"):
        titan_config(tmp_path)


def sampled_turns(model, n_turns: int, rng: np.random.Generator) -> list[TurnRecord]:
    """Turns whose 'sampler logprobs' are the model's own (teacher-forced), as vLLM would report."""
    turns, context = [], []
    for idx in range(n_turns):
        prompt = rng.integers(0, 2000, 6).tolist()
        output = rng.integers(0, 2000, 5).tolist()
        seq = context + prompt + output
        with torch.no_grad():
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0]
        lp = torch.log_softmax(logits.float(), -1)
        start = len(context) + len(prompt)
        logprobs = [float(lp[start + i - 1, t]) for i, t in enumerate(output)]
        turns.append(TurnRecord(idx=idx, segment=0, input_ids=prompt, output_ids=output, output_logprobs=logprobs,
                                policy_version=0, policy_version_end=0, finish_reason="stop", text="", tool_call=None,
                                observation="o", generation_s=0.0, tool_s=0.0))
        context = seq
    return turns


async def fill_buffer(engine, model, rewards_by_group: list[list[float]], samples: int = 2,
                      sampler: str = "oracle", **run) -> uuid.UUID:  # fmt: skip
    """A run of 3 tasks x `samples` episodes whose groups are ready with these rewards; the turns
    are the model's own samples (the same every time for the same model)."""
    run_id = await make_run(engine, sampler=sampler, samples_per_task=samples, **run)
    await finish_groups(engine, model, run_id, rewards_by_group)
    return run_id


async def finish_groups(engine, model, run_id: uuid.UUID, rewards_by_group: list[list[float]], first: int = 0) -> None:
    """The run's groups from number `first` (in id order) made ready with these rewards."""
    buffer = Buffer(engine)
    rng = np.random.default_rng(first)
    async with engine.connect() as conn:
        groups = (await conn.execute(sa.select(Group.id).where(Group.run_id == run_id).order_by(Group.id))).scalars().all()
    for group_id, rewards in zip(groups[first:], rewards_by_group):
        async with engine.connect() as conn:
            episodes = (await conn.execute(sa.select(Episode.id).where(Episode.group_id == group_id)
                                           .order_by(Episode.sample_index))).scalars().all()
        for episode_id, reward in zip(episodes, rewards):
            for turn in sampled_turns(model, 2, rng):
                await buffer.append_turn(episode_id, turn)
            await buffer.finish_episode(episode_id, status="submitted", reward=reward, n_turns=2,
                                        policy_version_min=0, policy_version_max=0)


@pytest.fixture
async def engine(db_url):
    engine = db.make_async_engine(db_url)
    yield engine
    await engine.dispose()


async def test_training_loop_consumes_groups_and_publishes_versions(engine, db_url, tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.config import TrainerConfig
    from trainer.model import build_model
    from trainer.train import Trainer

    model, _, _ = build_model(tiny["dense"])
    run_id = await fill_buffer(engine, model, [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    cfg = TrainerConfig(model=tiny["dense"], out_dir=tmp_path, steps=2, groups_per_step=1, run_id=run_id, publish_shard_mb=1,
                        optim={"lr": 1e-3}, data={"seq_len": 64}, wait_s=5)
    trainer = Trainer(cfg, engine)
    history = await trainer.run()
    assert [m["step"] for m in history] == [1, 2]
    first = history[0]
    assert first["mismatch_kl"] < 1e-6 and first["masked_fraction"] == 0  # the data came from these weights
    assert first["sampled_tokens"] == 2 * 2 * 5 and first["zero_advantage_groups"] == 0
    assert history[1]["zero_advantage_groups"] == 1  # the all-zero group rode along, counted
    assert first["reward_mean"] == 0.5 and first["advantage_mean"] == 0 and first["packing_efficiency"] > 0.5
    assert history[1]["mismatch_kl"] > 0  # the second group was sampled by version 0, trained at version 1
    async with engine.connect() as conn:
        policies = (await conn.execute(sa.select(Policy.version, Policy.weights_path, Policy.trainer_step)
                                       .order_by(Policy.version))).all()
        groups = dict((await conn.execute(sa.select(Group.status, sa.func.count()).where(Group.run_id == run_id)
                                          .group_by(Group.status))).all())
    assert [p.version for p in policies] == [0, 1, 2] and policies[2].trainer_step == 2
    assert groups == {"consumed": 3}
    lines = (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    from tests.conftest import client_for, make_settings

    async with client_for(make_settings(db_url)) as client:
        listed = (await client.get("/api/v1/policies")).json()
    assert [p["version"] for p in listed["items"]] == [2, 1, 0]
    assert listed["items"][1]["metrics"]["loss"] == pytest.approx(history[0]["loss"])
    from safetensors.torch import load_file

    published = Path(policies[2].weights_path)
    index = json.loads((published / "model.safetensors.index.json").read_text())
    files = sorted(published.glob("model-*-of-*.safetensors"))
    assert len(files) > 1 and set(index["weight_map"].values()) == {f.name for f in files}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for f in files
                                                   for v in load_file(str(f)).values())
    served = AutoModelForCausalLM.from_pretrained(published, dtype=torch.float32).eval()
    ids = torch.randint(0, 2000, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, trainer.model(ids, torch.arange(40)[None]).float(),
                                   atol=1e-5, rtol=0)
        assert not torch.allclose(served(ids).logits, hf_logits(tiny["dense"], ids))


async def test_a_step_filling_up_with_useful_groups_holds_no_useless_one_against_the_gate(engine, tiny, tmp_path):
    """DAPO's dynamic sampling under the orchestrator's bound on groups waiting to be trained on
    ((max_off_policy_steps + 1) x groups_per_step): a group that teaches nothing is consumed as
    soon as the trainer loads it, so the next group may start while the step waits for a useful
    one. Held in the claim until the step, it filled the bound: no group started, and the step
    waited for one until wait_s (`swerve rl` with the trainer's default fill_useful)."""
    from service.control.orchestrator import _gate
    from tests.test_orchestrator import config
    from trainer.config import TrainerConfig
    from trainer.model import build_model
    from trainer.train import Trainer

    model, _, _ = build_model(tiny["dense"])
    run_id = await fill_buffer(engine, model, [[0.0, 0.0]], sampler="vllm", groups_per_step=1, max_off_policy_steps=0)
    run_cfg = await config(engine, run_id)

    async def room() -> int:
        async with engine.connect() as conn:
            return (await _gate(conn, run_id, run_cfg, None))[1]

    async def status() -> list[tuple]:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.select(Group.status, Group.trainer_step).where(Group.run_id == run_id)
                                       .order_by(Group.id))).all()
        return [tuple(r) for r in rows]

    assert await room() == 0  # the ready group that teaches nothing fills the bound of 1
    cfg = TrainerConfig(model=tiny["dense"], out_dir=tmp_path, groups_per_step=1, run_id=run_id,
                        max_off_policy_steps=0, data={"seq_len": 64}, wait_s=60)
    assert cfg.fill_useful
    trainer = Trainer(cfg, engine)
    step = asyncio.create_task(trainer.claim())
    for _ in range(300):
        if (await status())[0][0] != "ready":
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.5)  # the trainer has polled for more at least once
    assert await status() == [("consumed", 1), ("pending", None), ("pending", None)]
    assert not step.done() and await room() == 1  # the next group may start
    await finish_groups(engine, model, run_id, [[1.0, 0.0]], first=1)
    claims, taken, dropped, useless = await asyncio.wait_for(step, 30)
    assert (len(taken), dropped, useless) == (2, 0, 1)
    assert [len(c.group_ids) for c in claims] == [1]  # the useful group only, committed with the step
    assert await trainer.commit(claims) is None
    assert await status() == [("consumed", 1), ("consumed", 1), ("pending", None)]


def golden_step(tiny_dir: Path) -> dict:
    """One training step of the seed-0 tiny dense model on a fixed hand-made batch."""
    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    trainer = Trainer(TrainerConfig(model=tiny_dir, out_dir=Path("/nonexistent"), device="cpu", **GOLDEN_CONFIG))
    return trainer.train_batch(trainer.prepare([golden_group()]))


def test_golden_loss(tiny):
    """Seed-0 tiny model, fixed batch: the loss and gradient norm recorded on this machine (CPU,
    float32) to 1e-6."""
    metrics = golden_step(tiny["dense"])
    assert metrics["sampled_tokens"] == GOLDEN["sampled_tokens"]
    assert metrics["loss"] == pytest.approx(GOLDEN["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(GOLDEN["grad_norm"], abs=1e-5)


def test_batch_normalisation_counts_the_samples_the_step_leaves_out(tiny):
    """normalize "batch" under skip_zero: the golden group trains one sample of three (advantages
    0.5, 0 and 0 with positive updates only), and its loss and gradient are a third of "token"'s,
    which divides by the trained sample's tokens alone."""
    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    def step(normalize):
        cfg = {**GOLDEN_CONFIG, "data": {**GOLDEN_CONFIG["data"], "negative_scale": 0.0, "skip_zero": True},
               "loss": {**GOLDEN_CONFIG["loss"], "normalize": normalize}}
        trainer = Trainer(TrainerConfig(model=tiny["dense"], out_dir=Path("/nonexistent"), device="cpu", **cfg))
        batch = trainer.prepare([golden_group()])
        return batch, trainer.train_batch(batch)

    (token_batch, token), (batch_batch, batch) = step("token"), step("batch")
    assert token_batch.n_tokens == batch_batch.n_tokens == 15 and token_batch.norm_tokens == 15
    assert batch_batch.norm_tokens == GOLDEN["sampled_tokens"] == 45
    assert batch["loss"] == pytest.approx(token["loss"] / 3, rel=1e-5)
    assert batch["grad_norm"] == pytest.approx(token["grad_norm"] / 3, rel=1e-4)


async def test_a_trainer_killed_after_committing_resumes_without_losing_or_reusing_groups(db_url, tiny, tmp_path):
    """Kill at the worst moment (step 2's groups committed, no checkpoint of step 2 yet):
    resuming puts those groups back, withdraws what step 2 published and redoes it; the result
    equals an uninterrupted run's, weight for weight."""
    from safetensors.torch import load_file

    from trainer.config import TrainerConfig
    from trainer.model import build_model
    from trainer.train import Trainer

    second = _second_database(db_url, tmp_path)

    async def setup(path_suffix: str):
        engine = db.make_async_engine(db_url if path_suffix == "a" else second)
        model, _, _ = build_model(tiny["dense"])
        run_id = await fill_buffer(engine, model, [[1.0, 0.0], [0.0, 1.0], [1.0, 0.5]])
        cfg = TrainerConfig(model=tiny["dense"], out_dir=tmp_path / path_suffix, steps=2, groups_per_step=1,
                            run_id=run_id, optim={"lr": 1e-3}, data={"seq_len": 64}, wait_s=5, checkpoint_every=1)
        return engine, cfg, run_id

    engine_a, cfg_a, _ = await setup("a")
    await Trainer(cfg_a, engine_a).run()
    engine_b, cfg_b, run_b = await setup("b")
    try:
        crashing = crashing_trainer(crash_at=2)(cfg_b.model_copy(update={"steps": 3}), engine_b)
        with pytest.raises(RuntimeError, match="crash injected"):
            await crashing.run()
        async with engine_b.connect() as conn:
            consumed_at_2 = await conn.scalar(sa.select(sa.func.count()).select_from(Group).where(Group.trainer_step == 2))
        assert consumed_at_2 == 1  # committed before the crash
        resumed = Trainer(cfg_b.model_copy(update={"steps": 1}), engine_b)
        history = await resumed.run()
        assert [m["step"] for m in history] == [2]
        async with engine_b.connect() as conn:
            steps = (await conn.execute(sa.select(Group.status, Group.trainer_step).where(Group.run_id == run_b)
                                        .order_by(Group.trainer_step))).all()
            versions = (await conn.execute(sa.select(Policy.version).order_by(Policy.version))).scalars().all()
        assert sorted(tuple(s) for s in steps) == [("consumed", 1), ("consumed", 2), ("ready", None)]
        assert versions == [0, 1, 2]
        a = load_file(str(tmp_path / "a" / "debug" / "weights" / "v2" / "model.safetensors"))
        b = load_file(str(tmp_path / "b" / "debug" / "weights" / "v2" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        await engine_a.dispose()
        await engine_b.dispose()
        _drop_second(second)


def crashing_trainer(crash_at: int) -> type:
    """A Trainer that dies at the worst moment: step `crash_at` committed, its checkpoint not
    yet written (and nothing of it published)."""
    from trainer.train import Trainer

    class CrashingTrainer(Trainer):
        def save_checkpoint(self) -> Path:
            if self.step == crash_at:
                raise RuntimeError(f"crash injected after step {self.step} committed")
            return super().save_checkpoint()

    return CrashingTrainer


def _second_database(db_url: str, tmp_path: Path) -> str:
    """An empty migrated database of the same kind as db_url (dropped by _drop_second)."""
    if db_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'second.db'}"
    else:
        from tests.conftest import PG_ADMIN_URL

        url = db.create_database(PG_ADMIN_URL, f"swerve_test_{uuid.uuid4().hex[:12]}")
    db.upgrade(url)
    return url


def _drop_second(url: str) -> None:
    if url.startswith("postgresql"):
        from tests.conftest import PG_ADMIN_URL

        db.drop_database(PG_ADMIN_URL, url)


async def test_sft_warm_start_lowers_the_nll_of_scripted_trajectories(engine, tiny, tmp_path):
    """SFT on the same data path (advantage 1, loss on sampled tokens): scripted 'samples'
    carry logprob 0, which SFT ignores; the model's NLL of those tokens goes down."""
    from trainer.config import TrainerConfig
    from trainer.model import build_model
    from trainer.train import Trainer

    model, _, _ = build_model(tiny["dense"])
    run_id = await fill_buffer(engine, model, [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    async with engine.begin() as conn:  # what the oracle policy records: logprob 0 for every token
        from service.store.records import encode_logprobs
        from service.store.tables import Turn

        rows = (await conn.execute(sa.select(Turn.id, Turn.n_output_tokens))).all()
        for turn_id, n in rows:
            await conn.execute(sa.update(Turn).where(Turn.id == turn_id).values(output_logprobs=encode_logprobs([0.0] * n)))
    buffer = Buffer(engine)
    claim = await buffer.claim(3, trainer_step=0, max_staleness=9)
    groups = await buffer.load(claim)
    await buffer.release(claim)
    from trainer.data import DataConfig, pack, sequences_from_groups
    from trainer.loss import token_logprobs
    from trainer.model import forward_logits

    rows, _ = pack(sequences_from_groups(groups, DataConfig(advantage_one=True))[0], 64)

    def nll(m) -> float:
        total, n = 0.0, 0
        with torch.no_grad():
            for r in rows:
                lp, _ = token_logprobs(forward_logits(m, *(torch.from_numpy(x) for x in (r.inputs, r.positions, r.seq_ids))),
                                       torch.from_numpy(r.targets))
                total -= float(lp[torch.from_numpy(r.loss_mask)].sum())
                n += int(r.loss_mask.sum())
        return total / n

    before = nll(model)
    trainer = Trainer(TrainerConfig(model=tiny["dense"], out_dir=tmp_path, steps=3, groups_per_step=1, run_id=run_id,
                                    sft=True, optim={"lr": 3e-3}, data={"seq_len": 64}, wait_s=5), engine)
    history = await trainer.run()
    assert all(m["masked_fraction"] == 0 and m["mismatch_kl"] == 0 for m in history)
    assert nll(trainer.model) < before - 0.1


async def test_a_dataset_trains_epoch_after_epoch_on_the_same_groups_and_claims_none(engine, tiny, tmp_path):
    """trainer.dataset (SFT on demonstrations): the run's groups are a fixed dataset, taken
    groups_per_step at a time in an order shuffled per epoch; nothing is claimed or consumed, a
    resumed trainer goes on where its step says, and `epochs` ends it."""
    from service.store.tables import Group
    from trainer.config import TrainerConfig
    from trainer.model import build_model
    from trainer.train import Trainer

    model, _, _ = build_model(tiny["dense"])
    run_id = await fill_buffer(engine, model, [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])

    def cfg(**kw) -> TrainerConfig:
        return TrainerConfig(**{"model": tiny["dense"], "out_dir": tmp_path, "steps": 0, "groups_per_step": 2,
                                "sft": True, "dataset": {"run_id": str(run_id)}, "optim": {"lr": 1e-3},
                                "data": {"seq_len": 64}, "wait_s": 5} | kw)

    history = await Trainer(cfg(until_step=3), engine).run()
    assert [m["step"] for m in history] == [1, 2, 3]
    assert [m["groups"] for m in history] == [2, 1, 2]  # 3 groups: 2 steps an epoch, the second smaller
    assert all(m["staleness_mean"] is None and m["dropped_groups"] == 0 for m in history)
    async with engine.connect() as conn:
        statuses = (await conn.execute(sa.select(Group.status).where(Group.run_id == run_id))).scalars().all()
    assert sorted(statuses) == ["ready"] * 3  # nothing claimed, nothing consumed
    # resumed from step 3's checkpoint: one more step ends the second epoch, then epochs=2 stops it
    history = await Trainer(cfg(dataset={"run_id": str(run_id), "epochs": 2}), engine).run()
    assert [(m["step"], m["groups"]) for m in history] == [(4, 1)]


async def test_the_learning_rate_warms_up_over_the_first_steps_of_a_run(engine, tiny, tmp_path):
    """optim.warmup_steps: the update that makes version s+1 uses lr x (s+1)/(warmup_steps+1),
    counted from the run's start, so a resumed trainer goes on at the rate its step says. Adam's
    first update moves each parameter by about the learning rate (the gradient's sign), so the
    first step's largest move is the warmed-up rate, not the full one."""
    from trainer.config import TrainerConfig
    from trainer.model import build_model
    from trainer.train import Trainer

    model, _, _ = build_model(tiny["dense"])
    run_id = await fill_buffer(engine, model, [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    lr = 1e-3

    def cfg(**kw) -> TrainerConfig:
        return TrainerConfig(**{"model": tiny["dense"], "out_dir": tmp_path, "steps": 0, "groups_per_step": 1,
                                "sft": True, "dataset": {"run_id": str(run_id)}, "checkpoint_every": 1,
                                "optim": {"lr": lr, "warmup_steps": 3}, "data": {"seq_len": 64}, "wait_s": 5} | kw)

    first = Trainer(cfg(until_step=1), engine)
    before = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
    history = await first.run()
    moved = max(float((v - before[k]).abs().max()) for k, v in first.model.state_dict().items())
    largest = max(float(v.abs().max()) for v in before.values())
    rounding = 2 * torch.finfo(torch.float32).eps * (largest + lr)  # the update's and the difference's
    assert 0.9 * lr / 4 <= moved <= lr / 4 + rounding
    history += await Trainer(cfg(until_step=5), engine).run()
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5]
    assert [m["lr"] for m in history] == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr])


def test_the_learning_rate_decays_over_the_updates_before_decay_end():
    """optim.decay_steps: constant after the warmup, then down over the decay_steps updates that
    end at version decay_end (the last of them still moves), then min_lr_factor x lr on; a
    decay with nowhere to end is refused, naming the field."""
    from trainer.config import OptimConfig

    lr = 1e-3
    linear = OptimConfig(lr=lr, warmup_steps=1, decay_steps=4, decay_end=8)
    assert [linear.lr_at(s) for s in range(10)] == pytest.approx(
        [lr / 2, lr, lr, lr, lr, 3 * lr / 4, lr / 2, lr / 4, 0.0, 0.0])
    floor = OptimConfig(lr=lr, decay_steps=2, decay_end=2, decay_type="cosine", min_lr_factor=0.1)
    assert [floor.lr_at(s) for s in range(4)] == pytest.approx([lr, 0.55 * lr, 0.1 * lr, 0.1 * lr])
    assert OptimConfig(lr=lr).lr_at(10**6) == lr
    with pytest.raises(ValueError, match="decay_end"):
        OptimConfig(lr=lr, decay_steps=4)
    with pytest.raises(ValueError, match="decay_end"):
        OptimConfig(lr=lr, decay_steps=4, decay_end=3)


async def test_a_time_limit_stops_the_trainer_after_a_step(engine, tiny, tmp_path):
    from trainer.config import TrainerConfig
    from trainer.model import build_model
    from trainer.train import Trainer

    model, _, _ = build_model(tiny["dense"])
    run_id = await fill_buffer(engine, model, [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    cfg = TrainerConfig(model=tiny["dense"], out_dir=tmp_path, steps=0, groups_per_step=1, sft=True,
                        dataset={"run_id": str(run_id)}, time_limit_s=1e-6, data={"seq_len": 64}, wait_s=5)
    history = await Trainer(cfg, engine).run()
    assert [m["step"] for m in history] == [1]


async def test_sigkilled_trainer_process_resumes_exactly_once(migrated_pg_url, tiny, tmp_path):
    """`swerve train` killed with SIGKILL somewhere in its second step; started again, it goes
    on from its checkpoint: every group is consumed by exactly one step, versions 0..3 exist."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import _truncate_pg
    from trainer.model import build_model

    _truncate_pg(migrated_pg_url)
    engine = db.make_async_engine(migrated_pg_url)
    try:
        model, _, _ = build_model(tiny["dense"])
        await fill_buffer(engine, model, [[1.0, 0.0], [0.0, 1.0], [1.0, 0.5]])
        config = tmp_path / "t.toml"
        config.write_text(f'name = "killed"\nmodel = "{tiny["dense"]}"\nout_dir = "{tmp_path}"\n'
                          f'database_url = "{migrated_pg_url}"\ngroups_per_step = 1\nwait_s = 20\n'
                          '[data]\nseq_len = 64\n[optim]\nlr = 1e-3\n')
        env = clean_env() | {"OMP_NUM_THREADS": "1"}
        metrics = tmp_path / "killed" / "metrics.jsonl"
        first = subprocess.Popen([sys.executable, "-m", "service.cli", "train", "--config", str(config), "--steps=3"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "first.log", "w"))
        for _ in range(600):
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                break
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        done = subprocess.run([sys.executable, "-m", "service.cli", "train", "--config", str(config), "--steps=1"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        async with engine.connect() as conn:
            steps = sorted((await conn.execute(sa.select(Group.trainer_step).where(Group.status == "consumed")))
                           .scalars().all())
            versions = (await conn.execute(sa.select(Policy.version).order_by(Policy.version))).scalars().all()
        done_steps = versions[-1]
        assert versions == list(range(done_steps + 1)) and done_steps >= 2
        assert steps == list(range(1, done_steps + 1))  # one group per step, none twice, none lost
    finally:
        await engine.dispose()


def _row(vocab: int, lengths: list[int], seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pad = seq_len - sum(lengths)
    inputs = torch.randint(0, vocab, (seq_len,), generator=g)
    positions = torch.cat([torch.arange(n) for n in [*lengths, pad]])
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    return {"inputs": inputs, "positions": positions, "seq_ids": seq_ids, "targets": torch.roll(inputs, -1),
            "mask": seq_ids >= 0}


def _logprob_grads(model, row, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from trainer.model import forward_logprobs

    model.zero_grad(set_to_none=True)
    logp, _ = forward_logprobs(model, row["inputs"], row["positions"], row["seq_ids"], row["targets"], chunk=chunk)
    (logp * row["mask"]).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chunked_vocabulary_projection_equals_whole_row_logits(tiny):
    """Long rows never hold [L, vocab] logits: the projection and log-softmax run chunk by chunk
    under checkpointing. Same log-probs, same gradients."""
    from trainer.model import build_model

    model, cfg, _ = build_model(tiny["dense"])
    row = _row(cfg.vocab_size, [70, 41, 30], 160)
    whole, grads = _logprob_grads(model, row, chunk=0)
    chunked, chunked_grads = _logprob_grads(model, row, chunk=32)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    assert grads.keys() == chunked_grads.keys() and len(grads) > 5
    for name in grads:
        torch.testing.assert_close(chunked_grads[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_same_gradients(tiny, mode):
    from trainer.model import apply_activation_checkpointing, build_model

    model, cfg, _ = build_model(tiny["moe"])
    row = _row(cfg.vocab_size, [50, 30], 96)
    logp, grads = _logprob_grads(model, row, chunk=0)
    apply_activation_checkpointing(model, mode)
    assert any("checkpoint" in type(m).__name__.lower() for m in model.modules())
    logp_ac, grads_ac = _logprob_grads(model, row, chunk=0)
    torch.testing.assert_close(logp_ac, logp, atol=0, rtol=0)
    # parameters of a checkpointed block gain a wrapper prefix in named_parameters
    grads_ac = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads_ac.items()}
    assert grads_ac.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ac[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_float8_without_torchao_or_gpu_is_named(tiny, tmp_path):
    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    cfg = TrainerConfig(model=tiny["dense"], out_dir=tmp_path, device="cpu", parallelism={"float8": True})
    with pytest.raises(ValueError, match="parallelism.float8"):
        Trainer(cfg)


def test_ranks_get_the_same_number_of_micro_batches():
    """Under FSDP every forward and backward is a collective: documents are spread over the
    ranks by length and a rank with fewer passes idly, or the step would deadlock."""
    from trainer.data import Sequence, pack
    from trainer.parallel import micro_batches, projection_rounds

    rng = np.random.default_rng(0)
    seqs = [Sequence(tokens=rng.integers(0, 2000, n), sampled=np.r_[np.zeros(n // 2, bool), np.ones(n - n // 2, bool)],
                     inf_logprobs=np.zeros(n, np.float32), advantage=1.0) for n in (30, 25, 12, 9, 7)]
    rows, _ = pack(seqs, 48)
    # whole rows in one process, and on models that pack documents
    assert micro_batches(rows, 1, split_documents=True) == [[(i, 0, 48) for i in range(len(rows))]]
    assert micro_batches(rows, 2, split_documents=False) == [[(0, 0, 48)], [(1, 0, 48)]]
    shares = micro_batches(rows, 2, split_documents=True)
    assert len(shares[0]) == len(shares[1]) == 3
    units = [u for share in shares for u in share if u is not None]
    assert sorted(e - s for _, s, e in units) == [6, 8, 11, 24, 29]  # every document once (len-1 predictions)
    assert sum(u is None for share in shares for u in share) == 1  # one idle pass
    loads = [sum(e - s for u in share if u for _, s, e in [u]) for share in shares]
    assert abs(loads[0] - loads[1]) <= 29
    # every rank makes as many vocabulary projections per round as the rank that needs most
    pieces = projection_rounds(shares, chunk=10)
    needs = [[-(-(u[2] - u[1]) // 10) if u else 1 for u in round_] for round_ in zip(*shares)]
    assert pieces == [max(n) for n in needs] and max(pieces) == 3


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_checkpoint_after_a_step_without_data_loads_back(tiny, tmp_path, kind):
    """A step whose groups teach nothing (fill_useful off) leaves the optimizer without state,
    and MoE experts no token reached have none either: the checkpoint still holds every
    parameter's, so a resumed trainer loads it; the weights did not move."""
    from trainer import checkpoint
    from trainer.config import TrainerConfig
    from trainer.train import Trainer

    cfg = TrainerConfig(model=tiny[kind], out_dir=tmp_path, device="cpu", name="empty")
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_batch(trainer.prepare([]))
    assert metrics["sampled_tokens"] == 0 and metrics["loss"] == 0.0
    trainer.optimizer.step()
    trainer.step = 1
    trainer.save_checkpoint()
    resumed = Trainer(cfg)
    checkpoint.load(resumed.model, resumed.optimizer, checkpoint.checkpoints(trainer.dir)[-1])
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(resumed.optimizer.state.get(p) for p in resumed.model.parameters())
